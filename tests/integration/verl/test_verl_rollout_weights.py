"""Weight updates of ``rollout.name=sparsecorr`` through verl 0.9.1's bucketed transfer, on the
CPU: verl's real ``BucketedWeightSender`` with ``use_shm=True`` (a POSIX shared-memory bucket
over a ZMQ ``ipc://`` socket, as verl's vLLM backend uses where CUDA IPC is missing) against the
in-process server's ``update_weights_from_ipc`` (verl's ``BucketedWeightReceiver`` on a worker
thread, each bucket copied on the engine thread). Checked: the next greedy rollout equals a
direct ``generate`` of a model holding the new weights, over several buckets; a bad tensor name
fails the update after releasing the sender; a sender that never comes times out; nothing is
left behind (shared-memory segments unlinked, socket files removed, sockets and threads
closed). The adapter's path through Ray (bucketed, chosen on one node) is in test_verl_rollout_ray.py."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from tests.integration.verl.rollout_helpers import (
    PROMPTS,
    direct,
    make_server,
    need_verl_and_ray,
    policy_copy,
    save_tiny,
)

GREEDY = {"temperature": 0.0, "max_tokens": 6, "logprobs": True}
BUCKET_BYTES = 48 << 10  # below the tiny model's ~0.4 MiB (verl's knob is in whole MiB: set in bytes here)


@pytest.fixture(scope="module")
def transfer():
    need_verl_and_ray()
    pytest.importorskip("zmq", reason="pyzmq (verl's bucketed transfer imports zmq): make test-lowest installs it")
    from sparsecorr_verl.rollout.weights import transfer_module

    return transfer_module("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def _perturbed(ckpt, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.5 * torch.randn(p.shape, generator=g) for n, p in policy_copy(ckpt).named_parameters()}


def _loaded(ckpt, weights: dict[str, torch.Tensor]):
    model = policy_copy(ckpt)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("verl_weights_*")}


def _open_fds() -> set[str]:
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return fds


async def _receiving(server, handle: str, timeout_s: float = 30.0):
    """The server's receive, started first: verl's sender blocks its event loop on the socket
    (here the loop the in-process server shares; in verl the server is another process)."""
    receiving = asyncio.ensure_future(server.update_weights_from_ipc(handle, use_shm=True, timeout_s=timeout_s))
    await asyncio.sleep(0.05)
    return receiving


async def _send(transfer, server, weights, *, handle: str, timeout_s: float = 30.0):
    """verl's sender (unchanged: only its bucket is set below a MiB) against the server."""
    receiving = await _receiving(server, handle, timeout_s)
    sender = transfer.BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
    sender.bucket_size = BUCKET_BYTES
    await sender.async_send_weights(iter(list(weights.items())))
    return await receiving


def test_bucketed_update_then_rollout_equals_loading_the_weights(transfer, ckpt, tmp_path, monkeypatch):
    """Several buckets (counted at the server's copy), copied in place; the next greedy rollout
    equals ``generate`` on a model loaded with the new weights, and differs from before."""
    import sparsecorr_verl.rollout.server as server_module

    copies = []
    real_copy = server_module.copy_weights
    monkeypatch.setattr(server_module, "copy_weights", lambda m, b: copies.append(len(b)) or real_copy(m, b))
    server = make_server(ckpt)
    new = _perturbed(ckpt, 1)
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())
    handle = f"ipc://{tmp_path}/w.sock"

    async def run():
        await server.launch_server()
        before = await server.generate(PROMPTS[0], dict(GREEDY), "a")
        ids = {id(p) for p in server.model.parameters()}
        copied = await _send(transfer, server, new, handle=handle)
        assert {id(p) for p in server.model.parameters()} == ids  # in place
        after = [await server.generate(p, dict(GREEDY), f"b{i}") for i, p in enumerate(PROMPTS)]
        return before, copied, after

    before, copied, after = asyncio.run(run())
    assert model_bytes > 4 * BUCKET_BYTES and len(copies) >= 4 and sum(copies) == copied == len(new)
    reference = direct(_loaded(ckpt, new), list(PROMPTS), max_new_tokens=6)
    for out, (tokens, logp) in zip(after, reference, strict=True):
        assert out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(logp), rtol=0, atol=1e-5)
    assert after[0].log_probs != before.log_probs


def test_nothing_is_left_after_updates(transfer, ckpt, tmp_path):
    """After two updates (the first warms pyzmq's shared context up): no ``verl_weights_*``
    segment in /dev/shm, no socket file, no file descriptor or thread more than after the first."""
    server = make_server(ckpt)
    handle = f"ipc://{tmp_path}/leak.sock"

    async def run():
        await server.launch_server()
        await _send(transfer, server, _perturbed(ckpt, 2), handle=handle)
        await asyncio.sleep(0.2)
        segs, fds, threads = _segments(), _open_fds(), threading.active_count()
        await _send(transfer, server, _perturbed(ckpt, 3), handle=handle)
        await asyncio.sleep(0.2)
        return segs, fds, threads

    segs, fds, threads = asyncio.run(run())
    assert _segments() == segs and not any("verl_weights_" in s for s in segs)
    assert not Path(handle[len("ipc://"):]).exists()
    assert not [f for f in _open_fds() - fds if "/dev/shm" in f or "socket" in f]
    assert threading.active_count() <= threads


def test_a_bad_name_fails_the_update_and_releases_the_sender(transfer, ckpt, tmp_path):
    """An unknown tensor name in the second bucket: the sender still finishes (it is not left
    waiting for an acknowledgement), the server raises the ValueError naming it, copies nothing
    after it, and goes on serving."""
    server = make_server(ckpt)
    new = _perturbed(ckpt, 4)
    names = list(new)
    bad = {**{n: new[n] for n in names[:3]}, "nope.weight": torch.zeros(64, 64), **{n: new[n] for n in names[3:]}}

    async def run():
        await server.launch_server()
        with pytest.raises(ValueError, match=r"named_tensors: 'nope.weight' is not a parameter"):
            await asyncio.wait_for(_send(transfer, server, bad, handle=f"ipc://{tmp_path}/bad.sock"), 60)
        return await server.generate(PROMPTS[1], dict(GREEDY), "after")

    out = asyncio.run(run())
    assert out.stop_reason == "completed" and len(out.token_ids) == 6
    assert not _segments()


def test_a_sender_that_never_comes_times_out(transfer, ckpt, tmp_path):
    """The receiving side gives up after ``timeout_s`` with a TimeoutError naming the socket;
    the server serves the next request."""
    server = make_server(ckpt)
    handle = f"ipc://{tmp_path}/none.sock"

    async def run():
        await server.launch_server()
        with pytest.raises(TimeoutError, match=r"none\.sock: no bucket arrived for 0\.3 s"):
            await server.update_weights_from_ipc(handle, use_shm=True, timeout_s=0.3)
        return await server.generate(PROMPTS[0], dict(GREEDY), "next")

    assert asyncio.run(run()).stop_reason == "completed"


def test_send_buckets_sends_through_verls_sender_with_the_adapters_knobs(transfer, ckpt, tmp_path):
    """The adapter's sender (`send_buckets`: verl's sender with a timeout, DTensor gathering,
    the bucket in whole MiB) against the server: the update equals loading the weights; a bucket
    size below 1 MiB is refused, naming verl's setting."""
    from sparsecorr_verl.rollout.weights import send_buckets

    server = make_server(ckpt)
    new = _perturbed(ckpt, 5)
    handle = f"ipc://{tmp_path}/adapter.sock"

    async def run():
        await server.launch_server()
        with pytest.raises(ValueError, match=r"update_weights_bucket_megabytes: expected >= 1, got 0"):
            await send_buckets([], handle=handle, bucket_megabytes=0, use_shm=True, device_type="cpu", timeout_s=5)
        receiving = await _receiving(server, handle)
        await send_buckets(iter(new.items()), handle=handle, bucket_megabytes=1, use_shm=True, device_type="cpu",
                           timeout_s=30)
        copied = await receiving
        return copied, await server.generate(PROMPTS[0], dict(GREEDY), "x")

    copied, out = asyncio.run(run())
    assert copied == len(new)
    assert out.token_ids == direct(_loaded(ckpt, new), [PROMPTS[0]], max_new_tokens=6)[0][0]


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        async def call():
            return self.fn(*args, **kwargs)

        return call()


class _FakeServer:
    """What the adapter asks a server actor, in process (Ray is not started here)."""

    def __init__(self, info):
        self.transfer_info = _Remote(lambda: dict(info))
        self.named, self.steps = [], []
        self.update_weights = _Remote(lambda bucket: self.named.append([n for n, _ in bucket]))
        self.set_global_steps = _Remote(self.steps.append)


@pytest.mark.parametrize(("info", "reason"), [
    ({"node_id": "node-b", "device": "cpu", "unavailable": None}, "the server runs on node node-b"),
    ({"node_id": None, "device": "cpu", "unavailable": "pyzmq is not installed (verl's bucketed transfer imports zmq)"},
     "pyzmq is not installed"),
])
def test_adapter_takes_named_tensors_where_the_bucketed_path_does_not_apply(transfer, ckpt, monkeypatch, info, reason):
    """A server on another node, or one without pyzmq: the adapter says why and sends the full
    tensors as host buckets through the server's ``update_weights`` (every name, in order)."""
    from sparsecorr_verl.rollout.adapter import SparseCorrServerAdapter

    from tests.integration.verl.rollout_helpers import model_config, rollout_config

    if reason.startswith("the server"):
        import ray

        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Ctx", (), {"get_node_id": lambda self: "node-a"})())
    adapter = SparseCorrServerAdapter(config=rollout_config(), model_config=model_config(ckpt), device_mesh=None,
                                      replica_rank=0)
    adapter._server = _FakeServer(info)
    new = _perturbed(ckpt, 6)
    asyncio.run(adapter.update_weights(iter(new.items()), global_steps=4))
    assert adapter.weight_path == "named_tensors" and reason in adapter.weight_path_reason
    assert [n for bucket in adapter._server.named for n in bucket] == list(new)
    assert adapter._server.steps == [4]
