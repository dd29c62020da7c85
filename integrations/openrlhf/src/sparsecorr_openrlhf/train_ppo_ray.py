"""``python -m sparsecorr_openrlhf.train_ppo_ray``: OpenRLHF's launcher with sparsecorr inside.

Accepts every argument of ``python -m openrlhf.cli.train_ppo_ray`` plus:

    --sparsecorr.correction NAME     a sparsecorr preset: sparse_rl, tis, icepop, mis, sparrow,
                                     sparse_tail, geo_rs, veto, divergence, opsm, trl, none
                                     (default sparse_rl)
    --sparsecorr.cap X --sparsecorr.low X --sparsecorr.high X --sparsecorr.veto_threshold X
    --sparsecorr.q X --sparsecorr.tau X --sparsecorr.delta X --sparsecorr.threshold X
    --sparsecorr.floor X --sparsecorr.clip_min X --sparsecorr.clip_max X
                                     the preset's numbers (only those given are passed)
    --sparsecorr.mode M --sparsecorr.level L --sparsecorr.estimator E --sparsecorr.reduce R
                                     the preset's choices (e.g. trl: --sparsecorr.mode token_mask;
                                     mis: --sparsecorr.level sequence; divergence: estimator/reduce)
    --sparsecorr.quantiles Q [Q ...] log-ratio quantiles to log (default 0.01 0.05 0.5)

It validates the correction, exports it to Ray workers (``SPARSECORR_OPENRLHF`` plus a
``worker_process_setup_hook`` that patches the PPO actor in each worker), initialises Ray with
OpenRLHF's own environment defaults, then runs OpenRLHF's normal entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from .hook import ENV_VAR, correction_from_spec, install

NUMBERS = ("cap", "low", "high", "veto_threshold", "q", "tau", "delta", "threshold", "floor",
           "clip_min", "clip_max")
CHOICES = ("mode", "level", "estimator", "reduce")


def parse_sparsecorr_args(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Split ``--sparsecorr.*`` flags from OpenRLHF's; returns ``(spec, openrlhf_argv)``."""
    p = argparse.ArgumentParser(prog="sparsecorr_openrlhf.train_ppo_ray", add_help=False)
    p.add_argument("--sparsecorr.correction", dest="correction", default="sparse_rl")
    for name in NUMBERS:
        p.add_argument(f"--sparsecorr.{name}", dest=name, type=float, default=None)
    for name in CHOICES:
        p.add_argument(f"--sparsecorr.{name}", dest=name, default=None)
    p.add_argument("--sparsecorr.quantiles", dest="quantiles", type=float, nargs="+",
                   default=[0.01, 0.05, 0.5])
    ns, rest = p.parse_known_args(list(argv))
    numbers = {k: getattr(ns, k) for k in (*NUMBERS, *CHOICES) if getattr(ns, k) is not None}
    spec = {"name": ns.correction, "numbers": numbers, "quantiles": ns.quantiles}
    correction_from_spec(spec)  # fail fast with the preset's own error message
    return spec, rest


def _init_ray(spec: dict[str, Any]) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
        ENV_VAR: json.dumps(spec),
    }
    ray.init(runtime_env={"env_vars": env,
                          "worker_process_setup_hook": "sparsecorr_openrlhf.hook.setup_worker"})


def print_help() -> None:
    """This launcher's flags, then OpenRLHF's own ``--help``; never starts Ray or patches
    anything. OpenRLHF's launcher imports Ray at module level: without it, say so instead."""
    print(__doc__)
    print("OpenRLHF's own options (python -m openrlhf.cli.train_ppo_ray --help):\n", flush=True)
    argv = sys.argv
    sys.argv = ["openrlhf.cli.train_ppo_ray", "--help"]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    except SystemExit:
        pass  # argparse exits after printing help
    except ImportError as exc:
        print(f"  (not shown: OpenRLHF's launcher needs {exc.name or exc}, which is not "
              "installed here)")
    finally:
        sys.argv = argv


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print_help()
        return
    spec, rest = parse_sparsecorr_args(argv)
    os.environ[ENV_VAR] = json.dumps(spec)
    install(spec)  # the driver process (and local, non-Ray runs)
    _init_ray(spec)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *rest]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
