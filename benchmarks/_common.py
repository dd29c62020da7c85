"""Shared helpers for the benchmark scripts: timing with medians, tables, peak memory."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def setup(threads: int = 2) -> None:
    torch.set_num_threads(threads)


def machine() -> str:
    return (f"{platform.machine()} CPU, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, python {platform.python_version()}")


def median_time(fn: Callable[[], object], *, repeat: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def peak_rss_delta(snippet_setup: str, snippet_run: str) -> float:
    """Peak RSS growth (bytes) of running ``snippet_run`` after ``snippet_setup``, in a fresh
    subprocess. CPU has no allocator statistics, so this uses Linux's resettable high-water
    mark: after the setup, ``/proc/self/clear_refs`` resets VmHWM to the current VmRSS, and the
    growth is VmHWM after the run minus VmRSS before it."""
    code = (
        "import json, torch\n"
        "torch.set_num_threads(2)\n"
        "def status(key):\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(key):\n"
        "            return int(line.split()[1]) * 1024\n"
        f"{snippet_setup}\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = status('VmRSS')\n"
        f"{snippet_run}\n"
        "print(json.dumps(status('VmHWM') - base))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))

