"""verl's bucketed weight transfer over CUDA IPC into ``rollout.name=sparsecorr`` (marker
``gpu``; written, not yet run on a GPU): a child process (the trainer worker's stand-in) runs the
adapter's sender (`send_buckets`: verl's ``BucketedWeightSender``, ``use_shm=False``) from CUDA
tensors; the in-process server on CUDA receives with verl's ``BucketedWeightReceiver``. The
next greedy rollout equals a direct ``generate`` of a model loaded with the new weights."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

from tests.integration.verl.rollout_helpers import (
    PROMPTS,
    direct,
    make_server,
    need_verl_and_ray,
    save_tiny,
)

pytestmark = pytest.mark.gpu


def _child_send(path: str, handle: str) -> None:
    from sparsecorr_verl.rollout.weights import send_buckets

    weights = {n: t.cuda() for n, t in torch.load(path).items()}
    asyncio.run(send_buckets(iter(weights.items()), handle=handle, bucket_megabytes=1, use_shm=False,
                             device_type="cuda", timeout_s=60))


def test_cuda_ipc_update_then_rollout_equals_loading_the_weights(tmp_path):
    need_verl_and_ray()
    pytest.importorskip("zmq", reason="pyzmq (verl's bucketed transfer imports zmq)")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = save_tiny(tmp_path / "tiny")
    server = make_server(ckpt, dtype="float32")
    from sparsecorr_verl.rollout import load_policy_copy

    model = load_policy_copy(str(ckpt), device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    new = {n: p.detach() + 0.5 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    torch.save(new, tmp_path / "new.pt")
    handle = f"ipc://{tmp_path}/gpu.sock"

    async def run():
        await server.launch_server()
        receiving = asyncio.ensure_future(server.update_weights_from_ipc(handle, use_shm=False, timeout_s=60))
        await asyncio.sleep(0.05)
        child = mp.get_context("spawn").Process(target=_child_send, args=(str(tmp_path / "new.pt"), handle))
        child.start()
        copied = await receiving
        await asyncio.to_thread(child.join, 60)
        assert child.exitcode == 0
        out = await server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 6}, "after")
        return copied, out

    copied, out = asyncio.run(run())
    assert copied == len(new)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(new[n])
    assert out.token_ids == direct(model, [PROMPTS[0]], max_new_tokens=6)[0][0]
