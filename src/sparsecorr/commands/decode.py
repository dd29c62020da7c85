"""``sparsecorr decode``: sparse rollouts from a local model directory and a prompts JSONL.

Every option, the prompts file and the output path are checked before the model is loaded;
a bad one exits with status 2 and one line naming the option.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from ..sampler import BACKENDS

#: the built-in policy names, for ``--help`` only (kept here so it stays fast); ``--policy``
#: takes any name in the registry (`sparsecorr.decoding.policies.POLICIES`)
POLICIES = ("dense", "streaming_llm", "snapkv", "rkv", "block_topk")
POLICY_HELP = ("a registered KV policy: " + " | ".join(POLICIES) + ", one a --policy-module registers, "
               "or MODULE:CLASS (imported and registered)")
GRAPH_MODES = ("auto", "on", "off")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("decode", help="generate sparse rollouts and write a RolloutBatch",
                       description="Generate responses with a sparse KV policy from a local Hugging "
                                   "Face model directory; write a RolloutBatch (one safetensors file).")
    p.add_argument("--model", required=True, help="local model directory (from_pretrained)")
    p.add_argument("--prompts", required=True,
                   help='JSONL, one {"prompt_ids": [...]} or {"prompt": "text"} per line')
    p.add_argument("--policy", default="rkv", help=POLICY_HELP + " (default rkv)")
    p.add_argument("--policy-module", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (repeatable), so the policies it registers with "
                        "@register_policy are --policy names (default: none)")
    p.add_argument("--budget", type=int, default=512, help="KV budget in tokens (default 512)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", help=" | ".join(BACKENDS) + " (default auto)")
    p.add_argument("--cuda-graph", default="auto", choices=GRAPH_MODES,
                   help="replay decode steps as CUDA graphs: auto (on for a CUDA device), on, off")
    p.add_argument("--fused", default="auto", choices=GRAPH_MODES,
                   help="compile the captured decode step (torch.compile): auto (on with the CUDA-graph step), "
                        "on (needs it), off")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill forward")
    p.add_argument("--device", default="auto", help="auto (cuda when available) | cpu | cuda | cuda:N")
    p.add_argument("--out", required=True, help="output path of the RolloutBatch (.safetensors)")
    return p


def _positive(name: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


def policy_name(spec: str, modules: list[str] | tuple[str, ...] = ()) -> str:
    """The registry name ``--policy spec`` selects, after importing each ``--policy-module``:
    a registered name, or ``MODULE:CLASS`` (imported and registered:
    `sparsecorr.decoding.policies.import_policy`). Raises ``ValueError`` naming the option."""
    import importlib

    from ..decoding.policies import POLICIES as registry
    from ..decoding.policies import import_policy

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"--policy-module: cannot import {module!r}: {exc}") from None
    if ":" in spec:
        try:
            return import_policy(spec)
        except ValueError as exc:
            raise ValueError(f"--policy: {str(exc).removeprefix('spec: ')}") from None
    if spec not in registry:
        raise ValueError(f"--policy: expected one of {sorted(registry)} (the registry; add one with "
                         f"--policy-module MODULE or --policy MODULE:CLASS), got {spec!r}")
    return spec


#: ``SamplerSpec`` field -> the flag that sets it (so its ValueError names the flag)
_FLAGS = {"policy": "--policy", "budget": "--budget", "backend": "--backend", "cuda_graph": "--cuda-graph",
          "fused": "--fused", "prefill_chunk": "--prefill-chunk"}
_MODES = {"auto": None, "on": True, "off": False}


def sampler_spec(args: argparse.Namespace):
    """The engine flags as the shared ``sparsecorr.sampler.SamplerSpec`` (``--budget`` is
    dropped for a policy that ignores it, e.g. ``dense``); a ``ValueError`` names the flag."""
    from ..decoding.policies import POLICIES
    from ..sampler import spec_from

    cls = POLICIES.get(args.policy)
    dense = cls is not None and cls.ignores_budget
    return spec_from({"policy": args.policy, "budget": None if dense else args.budget, "backend": args.backend,
                      "cuda_graph": _MODES.get(args.cuda_graph, args.cuda_graph),
                      "fused": _MODES.get(args.fused, args.fused), "prefill_chunk": args.prefill_chunk},
                     rename=_FLAGS)


def _check_options(args: argparse.Namespace) -> None:
    args.policy = policy_name(args.policy, getattr(args, "policy_module", ()))
    args.sampler_spec = sampler_spec(args)
    for name in ("max_new_tokens", "samples_per_prompt"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    _positive("--top-k", args.top_k, allow_none=True)
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature: expected a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p: expected a number in (0, 1], got {args.top_p}")


def _device(args: argparse.Namespace) -> str:
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {args.device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device} requested but torch.cuda.is_available() is False")
    if args.backend == "flashinfer":
        from ..decoding.backends.flashinfer import flashinfer_status

        ok, reason = flashinfer_status()
        if not ok or dev.type != "cuda":
            raise ValueError(f"--backend: {reason if not ok else 'flashinfer needs --device cuda'}")
    if args.cuda_graph == "on" and dev.type != "cuda":
        raise ValueError(f"--cuda-graph: on needs a CUDA device, got --device {device}")
    if args.fused == "on" and (args.cuda_graph == "off" or dev.type != "cuda"):
        raise ValueError("--fused: on compiles the CUDA-graph step, so it needs --cuda-graph on or auto and a CUDA "
                         f"device, got --cuda-graph {args.cuda_graph} --device {device}")
    return device


def _prompt_ids(i: int, row: object, tokenizer, vocab: int | None) -> list[int]:
    where = f"--prompts: line {i}"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'prompt_ids' or 'prompt', got {json.dumps(row)}")
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of ints, got {json.dumps(ids)}")
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
        return ids
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if tokenizer is None:
            raise ValueError(f"{where}: has text but the model directory has no tokenizer")
        return tokenizer(row["prompt"])["input_ids"]
    raise ValueError(f"{where} needs 'prompt_ids' or 'prompt'")


def _read_prompts(path: Path, tokenizer, vocab: int | None = None) -> list[list[int]]:
    """Prompt token ids, one list per JSONL line; ``vocab`` (if given) bounds the ids. (Also
    used by ``sparsecorr calibrate``.)"""
    if not path.is_file():
        raise ValueError(f"--prompts: no such file {path}")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--prompts: line {i} is not JSON ({exc})") from None
        prompts.append(_prompt_ids(i, row, tokenizer, vocab))
    if not prompts:
        raise ValueError(f"--prompts: {path} holds no prompt")
    return prompts


def _load_config(model_dir: Path):
    from transformers import AutoConfig, AutoTokenizer

    if not model_dir.is_dir() or not (model_dir / "config.json").is_file():
        raise ValueError(f"--model: expected a local model directory with a config.json, got {model_dir}")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # a broken config.json: one line, not a traceback
        raise ValueError(f"--model: cannot read {model_dir / 'config.json'}: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:
        tokenizer = None
    return config, tokenizer


def run(args: argparse.Namespace) -> int:
    from .._io import check_writable_file

    _check_options(args)
    device = _device(args)
    check_writable_file("--out", args.out)
    model_dir = Path(args.model)
    config, tokenizer = _load_config(model_dir)
    prompts = _read_prompts(Path(args.prompts), tokenizer, int(config.vocab_size))
    prompts = [p for p in prompts for _ in range(args.samples_per_prompt)]

    import torch
    from transformers import AutoModelForCausalLM

    from ..decoding import generate

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).to(device)
    model.eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    engine = args.sampler_spec.generate_kwargs(model.device.type)
    policy = engine["policy"]
    t0 = time.perf_counter()
    batch = generate(model, ids, mask, **engine, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k, top_p=args.top_p, eos_token_id=model.config.eos_token_id,
                     generator=torch.Generator().manual_seed(args.seed), progress=True)
    elapsed = time.perf_counter() - t0
    path = batch.save(args.out)  # an OSError (disk full) is one line from the CLI, status 1
    n_tok = int(batch.lengths.sum())
    kept = batch.kv_kept[batch.mask]
    print(f"wrote {path} ({len(prompts)} rollouts, {n_tok} tokens)")
    print(f"throughput: {n_tok / elapsed:.1f} tokens/s ({elapsed:.2f} s, policy {policy!r}, "
          f"backend {batch.meta['backend']}, cuda_graph {batch.meta['cuda_graph']}, "
          f"fused {batch.meta.get('fused', 'off')})")
    print(f"KV: peak {batch.peak_kv_bytes / 2**20:.2f} MiB, mean attended "
          f"{float(kept.mean()) if kept.numel() else 0.0:.1f} tokens per layer and head")
    return 0
