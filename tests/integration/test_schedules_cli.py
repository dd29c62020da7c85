import json

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
    assert main(["cost", "--preset", "qwen3-4b", "--schedule", str(sched), "--hardware", "tpu"]) == 2
    assert main(["schedule", "--table", str(tmp_path / "missing.json"), "--out", "x"]) == 2
