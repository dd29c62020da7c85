import json

import pytest

from sparsecorr.cli import main
from sparsecorr.schedules import BudgetSchedule, CalibrationTable
from tests.models import tiny_model


def test_calibrate_schedule_cost_cli(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_model("qwen3", vocab_size=64).save_pretrained(model_dir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": [5, 6, 7, 8]}) for _ in range(2)))
    out = tmp_path / "cal"
    assert main(["calibrate", "--model", str(model_dir), "--prompts", str(prompts),
                 "--budgets", "4,8", "--policy", "streaming_llm", "--bin-size", "8", "--n-bins", "3",
                 "--max-new-tokens", "16", "--samples-per-prompt", "1", "--logprobs-topk", "64",
                 "--out", str(out)]) == 0
    assert (out / "calibration.json").is_file() and (out / "calibration.png").stat().st_size > 1000
    table = CalibrationTable.load(out / "calibration.json")
    assert table.budgets == [4, 8]
    sched = tmp_path / "s.json"
    assert main(["schedule", "--table", str(out / "calibration.json"), "--tau", "0.5",
                 "--out", str(sched)]) == 0
    assert "| context tokens | budget |" in capsys.readouterr().out
    assert BudgetSchedule.load(sched).bin_size == 8
    assert main(["cost", "--preset", "qwen3-4b", "--schedule", "sparrow-qwen3-4b-0.86"]) == 0
    text = capsys.readouterr().out
    assert "speedup" in text and text.count("\n") >= 22
    with pytest.raises(SystemExit) as exc:  # an argparse choice: refused while parsing
        main(["cost", "--preset", "qwen3-4b", "--schedule", str(sched), "--hardware", "tpu"])
    assert exc.value.code == 2
    assert main(["schedule", "--table", str(tmp_path / "missing.json"), "--out", "x"]) == 2


# -- validation before work, kill-and-resume with changed arguments (issue #14) -------------------
import os  # noqa: E402

import torch  # noqa: E402

import sparsecorr.decoding as dec  # noqa: E402
from sparsecorr.decoding import StreamingLLM  # noqa: E402
from sparsecorr.schedules import calibrate  # noqa: E402

KW = dict(bin_size=8, n_bins=3, max_new_tokens=10, logprobs_topk=64, seed=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", vocab_size=64)


def _prompts():
    return torch.randint(3, 64, (2, 4), generator=torch.Generator().manual_seed(0))


def _count_generate(monkeypatch, *, fail_on: int | None = None):
    """Count calls to decoding.generate; raise KeyboardInterrupt (a kill) on call ``fail_on``."""
    calls, real = [], dec.generate

    def wrapped(*a, **k):
        calls.append(k.get("budget"))
        if fail_on is not None and len(calls) == fail_on:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(dec, "generate", wrapped)
    return calls


def test_kill_and_resume_with_changed_arguments(model, tmp_path, monkeypatch):
    policy, path = StreamingLLM(sink=1), tmp_path / "calibration.json"
    calls = _count_generate(monkeypatch, fail_on=2)
    with pytest.raises(KeyboardInterrupt):  # killed while calibrating budget 8
        calibrate(model, _prompts(), policy=policy, budgets=[4, 8], out=tmp_path, **KW)
    assert calls == [4, 8]
    killed = path.read_bytes()
    counts_4 = CalibrationTable.load(path).counts[0].clone()
    assert CalibrationTable.load(path).meta["done"] == [4]

    # settings that change what a token means are refused, naming each; the file is untouched
    for change, named in ((dict(bin_size=16), "bin_size: 8 in the file, 16 now"),
                          (dict(n_bins=4), "n_bins"), (dict(seed=1), "seed: 0 in the file, 1 now"),
                          (dict(max_new_tokens=12), "max_new_tokens"),
                          (dict(logprobs_topk=32), "logprobs_topk")):
        calls = _count_generate(monkeypatch)
        with pytest.raises(ValueError, match=named):
            calibrate(model, _prompts(), policy=policy, budgets=[4, 8], out=tmp_path, **{**KW, **change})
        assert calls == [] and path.read_bytes() == killed
    with pytest.raises(ValueError, match="policy"):
        calibrate(model, _prompts(), policy=StreamingLLM(sink=2), budgets=[4, 8], out=tmp_path, **KW)
    with pytest.raises(ValueError, match="prompts"):
        calibrate(model, _prompts() + 1, policy=policy, budgets=[4, 8], out=tmp_path, **KW)

    # new budgets extend the table, a new q re-reads it: only 8 (unfinished) and 16 (new) run
    calls = _count_generate(monkeypatch)
    table = calibrate(model, _prompts(), policy=policy, budgets=[4, 8, 16], out=tmp_path, q=0.5, **KW)
    assert calls == [8, 16]
    assert table.budgets == [4, 8, 16] and table.q == 0.5 and table.meta["done"] == [4, 8, 16]
    assert torch.equal(table.counts[0], counts_4)  # the done budget was kept, not recomputed
    assert CalibrationTable.load(path).q == 0.5

    # asking for fewer budgets later keeps every measured one and computes nothing
    calls = _count_generate(monkeypatch)
    assert calibrate(model, _prompts(), policy=policy, budgets=[4], out=tmp_path, **KW).budgets == [4, 8, 16]
    assert calls == []


def test_killed_budget_that_is_no_longer_asked_for_is_dropped(model, tmp_path, monkeypatch):
    policy = StreamingLLM(sink=1)
    _count_generate(monkeypatch, fail_on=2)
    with pytest.raises(KeyboardInterrupt):
        calibrate(model, _prompts(), policy=policy, budgets=[4, 8], out=tmp_path, **KW)
    calls = _count_generate(monkeypatch)
    table = calibrate(model, _prompts(), policy=policy, budgets=[4, 16], out=tmp_path, **KW)
    assert calls == [16] and table.budgets == [4, 16]


def test_bad_arguments_fail_before_the_first_budget(model, tmp_path, monkeypatch):
    calls = _count_generate(monkeypatch)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for kwargs, named in ((dict(q=1.5), "q"), (dict(q=float("nan")), "q"), (dict(bin_size=0), "bin_size"),
                          (dict(n_bins=10**7), "n_bins"), (dict(budgets=[4, -1]), r"budgets\[1\]"),
                          (dict(temperature=float("nan")), "temperature"),
                          (dict(samples_per_prompt=0), "samples_per_prompt"),
                          (dict(out=a_file), "out"), (dict(out=a_file / "sub"), "out")):
        args = {**KW, "budgets": [4], "out": tmp_path / "cal", **kwargs}
        with pytest.raises(ValueError, match=named):
            calibrate(model, _prompts(), policy=StreamingLLM(sink=1), **args)
    with pytest.raises(ValueError, match="prompts"):
        calibrate(model, _prompts().float(), policy=StreamingLLM(sink=1), budgets=[4], **KW)
    assert calls == [] and not (tmp_path / "cal" / "calibration.json").exists()


def _cli_args(model_dir, prompts, out, *extra):
    return ["calibrate", "--model", str(model_dir), "--prompts", str(prompts), "--budgets", "4",
            "--policy", "streaming_llm", "--bin-size", "8", "--n-bins", "2", "--max-new-tokens", "6",
            "--samples-per-prompt", "1", "--logprobs-topk", "64", "--out", str(out), *extra]


def test_calibrate_cli_checks_out_and_resume_before_loading_the_model(model, tmp_path, capsys, monkeypatch):
    import transformers

    model_dir, prompts = tmp_path / "model", tmp_path / "p.jsonl"
    model.save_pretrained(model_dir)
    prompts.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    out = tmp_path / "cal"
    assert main(_cli_args(model_dir, prompts, out)) == 0
    png = out / "calibration.png"
    umask = os.umask(0)
    os.umask(umask)
    assert png.stat().st_size > 1000 and (png.stat().st_mode & 0o777) == 0o666 & ~umask
    assert ((out / "calibration.json").stat().st_mode & 0o777) == 0o666 & ~umask
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left behind
    capsys.readouterr()

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the checks")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for bad_out, extra, named in ((a_file, [], "--out"), (a_file / "sub", [], "--out"),
                                  (out, ["--bin-size", "16"], "bin_size: 8 in the file, 16 now"),
                                  (out, ["--n-bins", "3000000"], "n_bins")):
        argv = _cli_args(model_dir, prompts, bad_out)
        for i in range(0, len(extra), 2):
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0] and err[0].startswith("sparsecorr calibrate: error:"), err
