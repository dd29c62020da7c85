"""A calibrate rerun that changes only ``q`` re-writes the table at the new level (issue 30).

Every budget is already done, so nothing is measured; the file must still hold the returned
table (the new ``q``), and the command line must say which ``q`` it wrote.
"""

import json

import pytest
import torch

import sparsecorr.decoding as dec
from sparsecorr.cli import main
from sparsecorr.decoding import StreamingLLM
from sparsecorr.schedules import CalibrationTable, calibrate
from tests.models import tiny_model

KW = dict(policy=StreamingLLM(sink=1), budgets=[4], bin_size=8, n_bins=2, max_new_tokens=4,
          logprobs_topk=64, seed=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", vocab_size=64)


def _prompts():
    return torch.randint(3, 64, (2, 4), generator=torch.Generator().manual_seed(0))


def test_rerun_with_only_q_changed_rewrites_the_file(model, tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    first = calibrate(model, _prompts(), out=tmp_path, **KW)
    assert CalibrationTable.load(path).q == 0.05
    calls, real = [], dec.generate
    monkeypatch.setattr(dec, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = calibrate(model, _prompts(), out=tmp_path, q=0.25, **KW)
    assert calls == []  # nothing recomputed
    saved = CalibrationTable.load(path)
    assert again.q == 0.25 and saved.q == 0.25
    torch.testing.assert_close(saved.values, again.values, equal_nan=True)
    assert torch.equal(saved.counts, first.counts)  # the same tokens, read at another level
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_cli_rerun_with_only_q_changed_writes_what_it_says(model, tmp_path, capsys):
    model_dir, prompts, out = tmp_path / "model", tmp_path / "p.jsonl", tmp_path / "cal"
    model.save_pretrained(model_dir)
    prompts.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    argv = ["calibrate", "--model", str(model_dir), "--prompts", str(prompts), "--budgets", "4",
            "--policy", "streaming_llm", "--bin-size", "8", "--n-bins", "2", "--max-new-tokens", "4",
            "--samples-per-prompt", "1", "--logprobs-topk", "64", "--out", str(out)]
    assert main(argv) == 0
    assert CalibrationTable.load(out / "calibration.json").q == 0.05
    capsys.readouterr()
    assert main([*argv, "--q", "0.25"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'calibration.json'} (q=0.25" in printed, printed
    assert CalibrationTable.load(out / "calibration.json").q == 0.25
    # a later schedule fit reads the new level
    sched = tmp_path / "s.json"
    assert main(["schedule", "--table", str(out / "calibration.json"), "--tau", "0.5",
                 "--out", str(sched)]) == 0
