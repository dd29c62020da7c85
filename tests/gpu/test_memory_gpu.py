"""Issue 34 on a CUDA GPU: a loop that calls ``generate`` every step holds flat memory.

40 graph-mode calls, with Python's cycle collector off and no ``gc.collect()``: the memory
allocated after each call returns equals its value after the first call within 1 MiB (one-time
workspaces, allocated by the first call, are fine; growth is not). Before issue 34 the pool stayed
allocated until a collection (a reference cycle between the engine and its graphs) and every
capture left a 32 MiB cuBLAS workspace behind (a new side stream per capture).
"""

import gc

import pytest
import torch

from sparsecorr.decoding import RKV, BlockTopK, Dense, SnapKV, StreamingLLM, generate
from tests.gpu.test_decoding_gpu import _model, _prompts

pytestmark = pytest.mark.gpu
MIB = 2**20


def _calls(model, ids, am, policies, n):
    after = []
    gc.disable()
    try:
        for i in range(n):
            out = generate(model, ids, am, policy=policies[i % len(policies)], budget=128, max_new_tokens=8,
                           temperature=0, cuda_graph=True, prefill_chunk=256)
            assert out.meta["cuda_graph"] == "on", out.meta["cuda_graph"]
            del out
            after.append(torch.cuda.memory_allocated())
    finally:
        gc.enable()
    return after


@pytest.mark.parametrize("policies", [[Dense()], [Dense(), StreamingLLM(buffer=16), SnapKV(buffer=16),
                                                   RKV(buffer=16), BlockTopK(dense_layers=1)]],
                         ids=["dense", "every-policy"])
def test_forty_graph_calls_hold_flat_memory(policies):
    model = _model(layers=2)
    ids, am = _prompts(b=4, p=512)
    before = torch.cuda.memory_allocated()
    after = _calls(model, ids, am, policies, 40)
    base = after[len(policies) - 1]  # one call of every policy: its one-time workspaces are in
    print(f"[{len(policies)} policies] before {before / MIB:.1f} MiB; after the first calls {base / MIB:.1f} MiB; "
          f"drift over the rest {[round((a - base) / MIB, 2) for a in after[len(policies):]]}")
    assert all(abs(a - base) <= MIB for a in after[len(policies):]), [(a - base) / MIB for a in after]
