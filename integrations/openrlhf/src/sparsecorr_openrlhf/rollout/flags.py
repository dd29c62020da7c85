"""The launcher's ``--sparsecorr.rollout POLICY`` and engine flags: the fields of the shared
``sparsecorr.sampler.SamplerSpec``, each a ``--sparsecorr.<field>`` flag.

    --sparsecorr.rollout POLICY      sparse rollout actors instead of vLLM's, with this KV policy
                                     (dense, streaming_llm, snapkv, rkv, block_topk)
    --sparsecorr.policy_kwargs JSON  the policy's arguments, e.g. '{"buffer": 64}'
    --sparsecorr.budget N            a constant KV budget (tokens per layer and head), or
    --sparsecorr.schedule PATH       a BudgetSchedule JSON (exactly one with a sparse policy)
    --sparsecorr.backend NAME        auto | torch | reference | flashinfer (default auto)
    --sparsecorr.cuda_graph MODE     auto | on | off: CUDA-graph decode steps (auto: on for CUDA)
    --sparsecorr.fused MODE          auto | on | off: the compiled captured step (auto: with graphs)
    --sparsecorr.prefill_chunk N     prompt tokens per prefill forward (default 512)
    --sparsecorr.max_num_seqs N      most rows resident per actor (default: the memory plan)
    --sparsecorr.max_kv_bytes N      bytes the KV pool may take per actor (default: 0.9 x free)
    --sparsecorr.dry_run             print each actor's arguments (JSON) and exit
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

__all__ = ["ENGINE_FLAGS", "parse_rollout_args"]

ENGINE_FLAGS = ("policy_kwargs", "budget", "schedule", "backend", "cuda_graph", "fused", "prefill_chunk",
                "max_num_seqs", "max_kv_bytes")
_MODES = {"auto": None, "on": True, "off": False}
_RENAME = {f: f"--sparsecorr.{f}" for f in ENGINE_FLAGS} | {"policy": "--sparsecorr.rollout"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsecorr_openrlhf.train_ppo_ray", add_help=False, allow_abbrev=False)
    p.add_argument("--sparsecorr.rollout", dest="rollout", default=None)
    p.add_argument("--sparsecorr.policy_kwargs", dest="policy_kwargs", default=None)
    p.add_argument("--sparsecorr.budget", dest="budget", type=int, default=None)
    p.add_argument("--sparsecorr.schedule", dest="schedule", default=None)
    p.add_argument("--sparsecorr.backend", dest="backend", default=None)
    p.add_argument("--sparsecorr.cuda_graph", dest="cuda_graph", choices=tuple(_MODES), default=None)
    p.add_argument("--sparsecorr.fused", dest="fused", choices=tuple(_MODES), default=None)
    for name in ("prefill_chunk", "max_num_seqs", "max_kv_bytes"):
        p.add_argument(f"--sparsecorr.{name}", dest=name, type=int, default=None)
    p.add_argument("--sparsecorr.dry_run", dest="dry_run", action="store_true")
    return p


def parse_rollout_args(argv: Sequence[str], *, with_dry_run: bool = False):
    """Split the rollout flags from the others: ``(sparsecorr.sampler.SamplerSpec or None, rest)`` (None without
    ``--sparsecorr.rollout``); with ``with_dry_run``, ``(spec, dry_run, rest)``.

    Raises:
        ValueError: an engine flag without ``--sparsecorr.rollout``, or a bad value (naming the
            flag: ``--sparsecorr.budget: ...``).
    """
    ns, rest = _parser().parse_known_args(list(argv))
    given = {f: getattr(ns, f) for f in ENGINE_FLAGS if getattr(ns, f) is not None}
    if ns.rollout is None:
        if given or ns.dry_run:
            first = next(iter(given), "dry_run")
            raise ValueError(f"--sparsecorr.{first}: an engine option of the sparse rollout actors, which need "
                             f"--sparsecorr.rollout POLICY, got no --sparsecorr.rollout")
        return (None, False, rest) if with_dry_run else (None, rest)
    if "policy_kwargs" in given:
        try:
            given["policy_kwargs"] = json.loads(given["policy_kwargs"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"--sparsecorr.policy_kwargs: expected a JSON object, got {ns.policy_kwargs!r} "
                             f"({exc})") from None
    for mode in ("cuda_graph", "fused"):
        if mode in given:
            given[mode] = _MODES[given[mode]]
    # the engine (and transformers) only when asked for
    from sparsecorr.sampler import spec_from

    spec = spec_from({"policy": ns.rollout, **given}, rename=_RENAME)
    return (spec, ns.dry_run, rest) if with_dry_run else (spec, rest)
