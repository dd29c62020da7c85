import json

import pytest

from sparsecorr.cli import main
from sparsecorr.decoding import RolloutBatch
from tests.models import tiny_model


def test_decode_cli_end_to_end(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_model("qwen3").save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": p}) for p in ([5, 6, 7], [9, 10, 11, 12, 13])))
    out = tmp_path / "batch.safetensors"
    rc = main(["decode", "--model", str(model_dir), "--prompts", str(prompts), "--policy", "rkv",
               "--budget", "8", "--max-new-tokens", "12", "--samples-per-prompt", "2", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "peak" in text
    batch = RolloutBatch.load(out)
    assert batch.tokens.shape == (4, 12) and batch.prompt_lengths.tolist() == [3, 3, 5, 5]


def test_decode_cli_clear_errors(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_model("qwen3").save_pretrained(model_dir)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    assert main(["decode", "--model", str(model_dir), "--prompts", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "needs 'prompt_ids' or 'prompt'" in capsys.readouterr().err
    assert main(["decode", "--model", str(tmp_path / "nope"), "--prompts", str(bad), "--out", "o"]) == 2
    with pytest.raises(SystemExit):
        main(["decode", "--model", str(model_dir)])  # missing required arguments
