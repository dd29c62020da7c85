"""The Benchmarks page opens with a summary built from a JSON file in the repository: the
block is what ``benchmarks/plot_summary.py`` renders from ``benchmarks/results/summary.json``,
every number in it comes from that JSON, each row names its device, commit and command, the
first screen holds the decode table and both plots, and the plots rebuild byte for byte."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _module():
    spec = importlib.util.spec_from_file_location("plot_summary",
                                                  ROOT / "benchmarks" / "plot_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ps = _module()


def _page() -> str:
    return (ROOT / "docs" / "benchmarks.md").read_text()


def test_summary_block_is_rendered_from_the_json():
    assert ps.page_block(_page()) == ps.render_summary(ps.load()), (
        "docs/benchmarks.md's summary differs from the JSON: run python benchmarks/plot_summary.py")


def test_every_number_in_the_summary_comes_from_a_json_file():
    """No hand-typed figure: each number on the summary's lines (tables, notes, commands) is a
    number of benchmarks/results/summary.json (the plots' display width aside)."""
    block = ps.page_block(_page())
    measured = {float(n) for n in NUMBER.findall(ps.JSON.read_text())}
    shown = NUMBER.findall(re.sub(r"\{ width=\"\d+%\" \}", "", block))  # layout, not a figure
    assert len(shown) > 150
    stray = sorted({n for n in shown if float(n) not in measured})
    assert not stray, f"numbers in the summary that no JSON row holds: {stray}"
    # and the headline figures are there, each from its row
    rows = {(r["context"], r["decoder"]): r for r in ps.load()["decode"]["rows"]}
    for (ctx, dec), ms in {("32k", "StreamingLLM"): "2.8", ("32k", "RKV"): "3.0", ("32k", "SnapKV"): "3.0",
                           ("32k", "Dense"): "12.1", ("32k", "HF generate (sdpa)"): "100.6"}.items():
        assert rows[ctx, dec]["ms_per_token"] == ms
        assert f"| {ctx} | {dec} | {ms} |" in block


def test_each_row_names_device_commit_and_command():
    data = ps.load()
    letters = ps._commands(data)
    block = ps.page_block(_page())
    for key in ps.SECTIONS:
        assert data[key]["rows"], key
        for row in data[key]["rows"]:
            for field in ("device", "commit", "date", "command", "source"):
                assert row.get(field), (key, row, field)
            assert row["source"] in data["sources"]
            assert re.fullmatch(r"[0-9a-f]{7}", row["commit"])
    rows = [ln for ln in block.splitlines() if ln.startswith("| ")
             and not ln.endswith("| device | commit (date) | command |")]
    assert len(rows) == sum(len(data[key]["rows"]) for key in ps.SECTIONS)
    for ln in rows:
        assert re.search(r"\| `[0-9a-f]{7}` \(2026-\d\d-\d\d\) \| \[[A-Z]\]\(#commands\) \|$", ln), ln
    for cmd, letter in letters.items():
        assert f"- **{letter}**: " in block and cmd in block
    # today's decode rows are the latest run of each: the 2026-11-27 evening H100 run at 37562e6
    # (every policy warmed up, so SnapKV's one-time Triton compile is out of its timed window)
    decode = data["decode"]["rows"]
    assert {(r["commit"], r["date"]) for r in decode} == {("37562e6", "2026-11-27")}


def test_first_screen_holds_the_decode_table_and_both_plots():
    page = _page()
    head = "\n".join(page.splitlines()[:45])
    assert "| context | decoder | ms / token |" in head
    assert f"assets/benchmarks/{ps.SPEED_PNG}" in head and f"assets/benchmarks/{ps.MEMORY_PNG}" in head
    assert page.index(ps.END) < page.index('--8<-- "benchmarks/RESULTS.md"')  # the record after


def test_results_md_carries_todays_gpu_rows_and_keeps_the_baseline():
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    today = results[results.index("## GPU rows today"):results.index("## MEASURE")]
    assert "`373458b`" in today and "H100 80GB HBM3" in today and "146 passed" in today
    assert "python benchmarks/bench_decoding_gpu.py --models qwen3-0.6b" in today
    assert "python benchmarks/bench_trl_step_gpu.py" in today
    # each decode row's figure is in the GPU section of RESULTS.md that names its commit
    sections = re.split(r"(?m)^(?=## )", results)
    for row in ps.load()["decode"]["rows"]:
        own = [sec for sec in sections if sec.startswith("## GPU rows") and f"`{row['commit']}`" in sec.splitlines()[0]]
        assert own and row["ms_per_token"] in own[0], row
    assert "## GPU baseline — H100 80GB HBM3, commit `1ac3959`" in results


def test_load_names_a_missing_section(tmp_path):
    data = json.loads(ps.JSON.read_text())
    del data["pruning"]
    bad = tmp_path / "summary.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'pruning'"):
        ps.load(bad)
    with pytest.raises(ValueError, match="summary markers"):
        ps.page_block("# no block here")


def test_plots_are_rebuilt_reproducibly(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    data = ps.load()
    first = [p.read_bytes() for p in ps.write_plots(data, tmp_path / "a")]
    second = [p.read_bytes() for p in ps.write_plots(data, tmp_path / "b")]
    assert first == second
    assert all(b[:8] == b"\x89PNG\r\n\x1a\n" for b in first)
    assert not list((tmp_path / "a").glob(".*.tmp.png"))
    lock = (ROOT / "requirements.lock").read_text()
    if f"matplotlib=={matplotlib.__version__}\n" in lock:  # the shipped PNGs: the lock's matplotlib
        shipped = [(ROOT / "docs" / "assets" / "benchmarks" / n).read_bytes()
                   for n in (ps.SPEED_PNG, ps.MEMORY_PNG)]
        assert first == shipped, "shipped plots are stale: run python benchmarks/plot_summary.py"
