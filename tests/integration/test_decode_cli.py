import json

import pytest

from sparsecorr.cli import main
from sparsecorr.decoding import RolloutBatch
from tests.models import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "model"
    tiny_model("qwen3").save_pretrained(path)
    return path


def _prompts(tmp_path, lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_decode_cli_end_to_end(tmp_path, capsys, model_dir):
    prompts = _prompts(tmp_path, [json.dumps({"prompt_ids": p}) for p in ([5, 6, 7], [9, 10, 11, 12, 13])])
    out = tmp_path / "batch.safetensors"
    rc = main(["decode", "--model", str(model_dir), "--prompts", str(prompts), "--policy", "rkv",
               "--budget", "8", "--max-new-tokens", "12", "--samples-per-prompt", "2", "--out", str(out),
               "--device", "cpu", "--prefill-chunk", "2"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "peak" in text and "backend torch" in text
    batch = RolloutBatch.load(out)
    assert batch.tokens.shape == (4, 12) and batch.prompt_lengths.tolist() == [3, 3, 5, 5]


BAD = [  # (what the error line must name, extra args, prompt lines)
    ("needs 'prompt_ids' or 'prompt'", [], ['{"text": "x"}']),
    ("--prompts: line 1: expected a JSON object", [], ["5"]),
    ("--prompts: line 1: expected a JSON object", [], ["null"]),
    ("--prompts: line 1: expected a JSON object", [], ["[[5]]"]),
    ("--prompts: line 1: expected a JSON object", [], ["[]"]),
    ("--prompts: line 2: 'prompt_ids' must be a non-empty list", [], ['{"prompt_ids": [5]}', '{"prompt_ids": []}']),
    ("--prompts: line 1: 'prompt_ids' must be", [], ['{"prompt_ids": [[5]]}']),
    ("--prompts: line 1: 'prompt_ids' must be", [], ['{"prompt_ids": [true]}']),
    ("--prompts: line 1: token id 128 is outside", [], ['{"prompt_ids": [5, 128]}']),
    ("--prompts: line 1: token id -1 is outside", [], ['{"prompt_ids": [-1]}']),
    ("--prompts: line 1 is not JSON", [], ["{"]),
    ("--prompts: line 1: 'prompt' must be a non-empty string", [], ['{"prompt": 5}']),
    ("--samples-per-prompt: expected an int >= 1", ["--samples-per-prompt", "0"], None),
    ("--top-p: expected a number in (0, 1]", ["--top-p", "2"], None),
    ("--top-p", ["--top-p", "0"], None),
    ("--top-k: expected an int >= 1", ["--top-k", "0"], None),
    ("--temperature", ["--temperature", "nan"], None),
    ("--budget", ["--budget", "0"], None),
    ("--max-new-tokens", ["--max-new-tokens", "0"], None),
    ("--prefill-chunk", ["--prefill-chunk", "-4"], None),
    ("--policy: expected one of", ["--policy", "h2o"], None),
    ("--backend: expected one of", ["--backend", "vllm"], None),
    ("--device", ["--device", "tpu"], None),
]


@pytest.mark.parametrize("needle,extra,lines", BAD, ids=[str(i) for i in range(len(BAD))])
def test_decode_cli_bad_input_is_one_line_before_model_work(tmp_path, capsys, model_dir, monkeypatch,
                                                            needle, extra, lines):
    import transformers

    loaded = []
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loaded.append(1) or real(*a, **k))
    prompts = _prompts(tmp_path, lines or ['{"prompt_ids": [5, 6]}'])
    rc = main(["decode", "--model", str(model_dir), "--prompts", str(prompts), "--out",
               str(tmp_path / "o.safetensors"), "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not loaded


def test_decode_cli_bad_paths(tmp_path, capsys, model_dir):
    prompts = _prompts(tmp_path, ['{"prompt_ids": [5, 6]}'])
    base = ["decode", "--model", str(model_dir), "--prompts", str(prompts), "--device", "cpu"]
    assert main([*base, "--out", str(tmp_path)]) == 2  # a directory
    assert "got the directory" in capsys.readouterr().err
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert main([*base, "--out", str(blocker / "b.safetensors")]) == 2  # under a file
    assert "is a file, not a directory" in capsys.readouterr().err
    assert main(["decode", "--model", str(tmp_path / "nope"), "--prompts", str(prompts), "--out", "o"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "o"), "--backend", "flashinfer"]) == 2
    assert "--backend" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["decode", "--model", str(model_dir)])  # missing required arguments
