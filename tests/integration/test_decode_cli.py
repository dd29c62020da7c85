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


#: a policy a user writes outside src/, registered on import (``--policy-module``)
RANDOM_EVICT = """
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsecorr.decoding.policies import EvictionPolicy, register_policy


@register_policy
@dataclass(frozen=True)
class RandomEvict(EvictionPolicy):
    name: ClassVar[str] = "random_evict_cli"
    window: int = 2
    buffer: int = 2
    sink: int = 0

    def score(self, *, keys, queries, valid, positions, query_valid=None):
        # pure: a fixed hash of the positions, no generator (replay reproduces it)
        return ((positions * 2654435761) % 1009).to(torch.float32)
"""


@pytest.fixture
def registry():
    from sparsecorr.decoding.policies import POLICIES

    before = dict(POLICIES)
    yield POLICIES
    POLICIES.clear()
    POLICIES.update(before)


@pytest.mark.parametrize("how", ["module:class", "policy-module"])
def test_decode_cli_runs_a_policy_defined_outside_src(tmp_path, capsys, model_dir, monkeypatch, registry, how):
    """A policy from a test file: ``--policy MODULE:CLASS`` (the toy of
    tests/unit/decoding/toy_policy.py) or ``--policy-module MODULE --policy NAME`` (a module
    that registers with ``@register_policy``) decodes end to end through the CLI."""
    if how == "module:class":
        args, name = ["--policy", "tests.unit.decoding.toy_policy:EveryOther"], "every_other"
    else:
        (tmp_path / "user_policy_cli.py").write_text(RANDOM_EVICT)
        monkeypatch.syspath_prepend(str(tmp_path))
        args, name = ["--policy-module", "user_policy_cli", "--policy", "random_evict_cli"], "random_evict_cli"
    prompts = _prompts(tmp_path, [json.dumps({"prompt_ids": list(range(5, 17))})])
    out = tmp_path / "batch.safetensors"
    rc = main(["decode", "--model", str(model_dir), "--prompts", str(prompts), *args, "--budget", "6",
               "--max-new-tokens", "8", "--out", str(out), "--device", "cpu", "--prefill-chunk", "4"])
    assert rc == 0, capsys.readouterr().err
    assert name in registry
    batch = RolloutBatch.load(out)
    assert batch.tokens.shape == (1, 8) and bool(batch.mask.all())
    assert f"policy {registry[name].__name__}(" in capsys.readouterr().out  # the throughput line
    assert int(batch.kv_kept[batch.mask].max()) <= 6 + registry[name]().buffer + 1


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
    ("--policy: cannot load 'tests.unit.decoding.toy_policy:Nope'",
     ["--policy", "tests.unit.decoding.toy_policy:Nope"], None),
    ("--policy: expected a KVPolicy subclass", ["--policy", "tests.unit.decoding.toy_policy:ToyState"], None),
    ("--policy-module: cannot import 'no_such_policy_module'", ["--policy-module", "no_such_policy_module"], None),
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
