"""Drive the engine's prefill + the model runner's decode loop directly (no ``generate``), so a
test can swap the graph runner (`EagerRunner`: the CUDA-graph step's static-buffer logic, run
eagerly on CPU), the backend or the engine's hooks before decoding."""

import torch

from sparsecorr.decoding.backends import TorchBackend
from sparsecorr.decoding.cache import ATTN_NAME, active_cache
from sparsecorr.decoding.engine import Engine, pool_capacity
from sparsecorr.decoding.graphs import EagerRunner
from sparsecorr.decoding.hf import sparse_attention
from sparsecorr.decoding.loops import Sampling, decode_loop, prefill
from sparsecorr.decoding.runner import ModelRunner
from sparsecorr.decoding.validate import budget_table


def alive(refs) -> int:
    """How many of the weak references ``refs`` still point at a live object."""
    return sum(r() is not None for r in refs)


class _Bar:
    def update(self, n):
        pass


def decode_steps(model, ids, policy, budget, *, graphs: bool = False, steps: int, backend=None, lens=None,
                 eos=None, events=None, runner=None):
    """Greedy prefill of ``ids`` ``[B, P]`` (row ``b`` has ``lens[b]`` prompt tokens; all by
    default) then ``steps`` decode steps; returns ``(fields, runner)`` (the `ModelRunner`, not
    closed: its ``engine`` and ``graphs`` are the test's to read). ``events`` (a list) is the
    engine's kept-set record. ``graphs``: the CUDA-graph step through `EagerRunner`;
    ``runner``: through that graph runner instead."""
    lens = torch.full((ids.shape[0],), ids.shape[1]) if lens is None else lens
    table = budget_table(budget, dense=policy.kind == "dense", longest=ids.shape[1] + steps)
    engine = Engine(model, policy=policy, backend=backend or TorchBackend(), table=table, batch=ids.shape[0],
                    capacity=pool_capacity(policy, table, longest=ids.shape[1] + steps, chunk=ids.shape[1]),
                    grad=False)
    if events is not None:
        engine.kept_events = events
    samp = Sampling(temperature=0.0, top_k=None, top_p=None, k=3, generator=None)
    with sparse_attention(model, ATTN_NAME), active_cache(engine.cache), torch.no_grad():
        logits = prefill(engine, ids, lens, ids.shape[1])
        model_runner = ModelRunner(engine, graph_runner=runner or EagerRunner if graphs or runner is not None else None)
        fields = decode_loop(model_runner, logits, prompt_len=lens, steps=steps, samp=samp, eos=eos, pruner=None,
                             group_size=None, bar=_Bar())
    return fields, model_runner
