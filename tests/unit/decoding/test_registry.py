"""Registry-driven tests: every registered policy (and a toy policy registered from a single
file, `tests.unit.decoding.toy_policy`) decodes, captures (the CUDA-graph step through the
eager stand-in runner), replays its recorded kept sets under teacher forcing, and leaves nothing
alive, through the public API only. The structural test: outside ``policies/`` no module of the
decoding package asks a policy's kind or name or imports a concrete policy, and the pool imports
nothing from ``policies/``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import sparsecorr.decoding as decoding
from sparsecorr.decoding import generate, teacher_forced_logprobs
from sparsecorr.decoding.policies import POLICIES, get_policy, register_policy
from tests.models import tiny_model
from tests.unit.decoding.drive import alive
from tests.unit.decoding.toy_policy import EveryOther

#: small settings per registered policy (the defaults otherwise): a buffer that makes the
#: 12-token prompts and 10-token decodes compress several times at budget 6
KWARGS = {"streaming_llm": {"sink": 1, "buffer": 2}, "snapkv": {"window": 3, "buffer": 2},
          "rkv": {"window": 3, "buffer": 2}, "block_topk": {"page_size": 4, "dense_layers": 1}}
NAMES = [*sorted(POLICIES), EveryOther.name]


@pytest.fixture
def registry():
    """The toy policy registered for the test (`register_policy`), and taken out after it."""
    register_policy(EveryOther)
    try:
        yield POLICIES
    finally:
        POLICIES.pop(EveryOther.name, None)


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (3, 12), generator=g)
    am = torch.ones_like(ids)
    am[1, :4] = 0  # a ragged row
    return ids, am


def _run(name, **kw):
    model = tiny_model("qwen3", num_layers=2)
    ids, am = _inputs()
    policy = get_policy(name, **KWARGS.get(name, {}))
    out = generate(model, ids, am, policy=policy, budget=6, max_new_tokens=10, temperature=0, backend="torch",
                   logprobs_topk=0, prefill_chunk=4, **kw)
    return model, policy, out


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_policy_decodes_captures_and_replays(name, registry, cpu_graphs):
    model, policy, eager = _run(name, record_keep=policy_evicts(name))
    assert torch.isfinite(eager.rollout_logp[eager.mask]).all() and bool(eager.mask.any())
    _, _, graph = _run(name, cuda_graph=True, fused=False)
    assert graph.meta["cuda_graph"] == "on"
    assert torch.equal(graph.tokens, eager.tokens)
    torch.testing.assert_close(graph.rollout_logp, eager.rollout_logp, atol=2e-5, rtol=0)
    torch.testing.assert_close(graph.kv_kept, eager.kv_kept)
    ids, am = _inputs()
    kw = dict(policy=policy, budget=6, attention_mask=am, response_mask=eager.mask, backend="torch",
              prefill_chunk=4, logprobs_topk=0, temperature=0)
    if policy_evicts(name):  # the recorded kept sets replayed: the decode's log-probs
        assert eager.kept_sets.rows.numel() > 0
        replay = teacher_forced_logprobs(model, ids, eager.tokens, keep_sets=eager.kept_sets, **kw)
    else:
        replay = teacher_forced_logprobs(model, ids, eager.tokens, **kw)
    torch.testing.assert_close(replay.rollout_logp[eager.mask], eager.rollout_logp[eager.mask], atol=1e-4, rtol=0)


def policy_evicts(name: str) -> bool:
    return get_policy(name, **KWARGS.get(name, {})).due(torch.tensor([100]), torch.tensor([100]),
                                                         budget_at=lambda c: torch.zeros_like(c)) is not None


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_policy_leaves_nothing_alive(name, registry, cpu_graphs, no_gc, tracked):
    _run(name, cuda_graph=True, fused=False)
    assert tracked and alive(tracked) == 0


def test_the_toy_policy_keeps_every_other_token_and_its_state_is_called(registry):
    """The toy's kept sets are its rule's (even positions first, the recent window always), and
    the engine called its state's hooks."""
    seen = []
    import sparsecorr.decoding.engine as engine_mod

    class Spy(engine_mod.Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen.append(self.cache.state)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(importlib_generate(), "Engine", Spy)
        _, policy, out = _run(EveryOther.name, record_keep=True)
    ks = out.kept_sets
    kept = ks.positions[ks.positions >= 0]
    ctx = ks.context[:, None, None, None].expand_as(ks.positions)[ks.positions >= 0]
    old = kept < ctx - policy.window  # outside the recent window: only even positions survive
    assert bool(old.any()) and bool((kept[old] % 2 == 0).all())
    (state,) = seen
    assert state.calls["plan"] > 10 and state.calls["observe"] > 0 and 0 < state.calls["event"] <= len(ks.rows)  # an event compresses one or more rows


def importlib_generate():
    import importlib

    return importlib.import_module("sparsecorr.decoding.generate")


def test_register_policy_refuses_what_is_not_a_new_policy(registry):
    with pytest.raises(ValueError, match="cls: expected a KVPolicy subclass"):
        register_policy(int)
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True)
    class Clash(EveryOther):
        name: ClassVar[str] = "rkv"

    with pytest.raises(ValueError, match="taken by RKV"):
        register_policy(Clash)
    assert register_policy(EveryOther) is EveryOther  # registering the same class again is a no-op


# -- structure ------------------------------------------------------------------------------------
DECODING = Path(decoding.__file__).parent
CONCRETE = {cls.__name__ for cls in POLICIES.values()} | {"EvictionPolicy"}


def _outside_policies():
    for path in sorted(DECODING.rglob("*.py")):
        rel = path.relative_to(DECODING)
        if rel.parts[0] != "policies" and rel != Path("__init__.py"):  # the package's face re-exports
            yield rel, ast.parse(path.read_text())


def test_no_module_outside_policies_asks_the_kind_or_name_or_imports_a_concrete_policy():
    found = []
    for rel, tree in _outside_policies():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("kind", "evicts") and \
                    "policy" in ast.unparse(node.value).lower():
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Compare) and any(
                    isinstance(n, ast.Attribute) and n.attr == "name" and "polic" in ast.unparse(n.value).lower()
                    for n in [node.left, *node.comparators]):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                names = {a.name for a in node.names}
                concrete_module = any(module.endswith(f"policies.{m}") for m in
                                      ("dense", "streaming_llm", "snapkv", "rkv", "block_topk"))
                if concrete_module or ("policies" in module and names & CONCRETE):
                    found.append(f"{rel}:{node.lineno}: from {module} import {sorted(names)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and \
                    any(n in ast.unparse(node) for n in CONCRETE):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_the_pool_imports_nothing_from_policies():
    tree = ast.parse((DECODING / "pool.py").read_text())
    imports = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imports += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imports if "polic" in m], imports
