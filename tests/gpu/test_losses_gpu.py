"""The loss path on a CUDA GPU equals the CPU (marker ``gpu``; skipped without CUDA).

The same plain code runs on every device (no device branch), so the CPU suite covers the GPU's
path; this pins it: loss, gradient and every metric of ``measure -> correction -> sparse_grpo``
on CUDA equal the CPU's, for every preset, surrogate and aggregation (the registries), and an
eager forward + backward on CUDA makes no host synchronisation.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.losses.test_compile import CASES, _HostSyncs, _inputs, _step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _on(device, inputs):
    logp, *rest = inputs
    return (logp.detach().to(device).requires_grad_(True), *(t.to(device) for t in rest))


@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_cuda_equals_cpu(kind, name):
    step = _step(kind, name)
    cpu, gpu = _on("cpu", _inputs()), _on("cuda", _inputs())
    loss_c, m_c = step(*cpu)
    loss_g, m_g = step(*gpu)
    loss_c.backward()
    loss_g.backward()
    torch.testing.assert_close(loss_g.cpu(), loss_c, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gpu[0].grad.cpu(), cpu[0].grad, rtol=1e-5, atol=1e-6)
    assert m_g.keys() == m_c.keys()
    for k in m_c:
        torch.testing.assert_close(m_g[k].cpu(), m_c[k], rtol=1e-5, atol=1e-5, equal_nan=True, msg=k)


@pytest.mark.parametrize("kind, name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_cuda_forward_and_backward_make_no_host_sync(kind, name):
    inputs = _on("cuda", _inputs())
    with _HostSyncs() as syncs:
        loss, _ = _step(kind, name)(*inputs)
        loss.backward()
    assert syncs.n == 0
