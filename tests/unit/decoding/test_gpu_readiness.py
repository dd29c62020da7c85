"""What a GPU run depends on, checked on CPU (issue 26, findings of the 2026-11-24 reading):
sampling draws its noise from a generator on the logits' device, a grad-enabled forward never
takes the paged (FlashInfer) path, a failed capture resets the paged backend, graph-mode paged
steps equal eager ones for every policy with a stand-in kernel that keeps FlashInfer's
graph-buffer contract, ``backend="auto"`` survives a broken FlashInfer install, and a paged step
makes no blocking copy."""

import dataclasses
import sys
import types
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparsecorr.decoding import (
    RKV,
    BlockTopK,
    Dense,
    SnapKV,
    StreamingLLM,
    generate,
    teacher_forced_logprobs,
)
from sparsecorr.decoding.backends import (
    PagedBackend,
    ReferenceDecodeKernel,
    TorchBackend,
    get_backend,
)
from sparsecorr.decoding.backends import flashinfer as fi
from sparsecorr.decoding.engine import Engine
from sparsecorr.decoding.graphs import EagerRunner
from sparsecorr.decoding.loops import (
    device_generator,
    sample_categorical,
)
from tests.models import tiny_model
from tests.unit.decoding.drive import decode_steps

POLICIES = [Dense(), StreamingLLM(sink=1, buffer=2), SnapKV(window=3, buffer=3), RKV(window=3, buffer=3),
            BlockTopK(page_size=4, dense_layers=1)]


class _Bar:
    def update(self, n):
        pass


def _paged():
    return PagedBackend(ReferenceDecodeKernel, name="paged-oracle")


# -- finding 2: sampling -------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_sample_categorical_draws_multinomials_tokens(seed):
    probs = torch.softmax(3 * torch.randn(16, 300, generator=torch.Generator().manual_seed(seed)), -1)
    probs[:, 100:200] = 0.0  # a truncated support (top-k / top-p)
    want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).squeeze(1)
    got = sample_categorical(probs, torch.Generator().manual_seed(seed))
    assert torch.equal(got, want)
    assert not bool((probs.gather(1, got[:, None]) == 0).any())


def test_device_generator_keeps_a_generator_on_the_logits_device():
    g = torch.Generator().manual_seed(3)
    assert device_generator(g, torch.device("cpu")) is g and device_generator(None, torch.device("cpu")) is None


def test_seeded_sampling_equals_multinomial_sampling(monkeypatch):
    """``generate`` at temperature > 0 draws the tokens torch.multinomial drew before (CPU)."""
    import sparsecorr.decoding.loops as loops

    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(policy=RKV(window=2, buffer=2), budget=6, max_new_tokens=12, temperature=0.9, top_p=0.95)
    got = generate(model, ids, generator=torch.Generator().manual_seed(7), **kw)
    monkeypatch.setattr(loops, "sample_categorical",
                        lambda p, g: torch.multinomial(p, 1, generator=g).squeeze(1))
    want = generate(model, ids, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(got.tokens, want.tokens)


# -- finding 6: no paged path under autograd ------------------------------------------------------
@pytest.mark.parametrize("policy", [StreamingLLM(sink=1), RKV(window=2, buffer=2), BlockTopK(page_size=4, dense_layers=1)],
                         ids=lambda p: p.name)
def test_grad_forward_never_takes_the_paged_path(policy):
    """DistillSparse's ``teacher_forced_logprobs(grad=True)``: the paged backend's gradients
    equal the torch backend's (the paged kernel has no backward, so a one-token chunk that went
    through it would lose the attention gradient)."""
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(4))
    resp = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    grads = []
    for backend in ("torch", _paged()):
        model.zero_grad()
        out = teacher_forced_logprobs(model, ids, resp, policy=policy, budget=6, backend=backend, grad=True,
                                      logprobs_topk=0, chunk_size=4)
        out.rollout_logp.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# -- finding 7: a failed capture resets the backend ----------------------------------------------
def test_failed_capture_resets_the_paged_backend():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(1))

    class Broken:
        def __init__(self, fn, **_):
            raise RuntimeError("operation not permitted when stream is capturing")

    eos = [11, 63, 90]
    ref, _ = decode_steps(model, ids, Dense(), None, backend=TorchBackend(), steps=24, eos=eos)
    assert ref["lengths"].unique().numel() > 1  # rows leave the batch at different steps
    with pytest.warns(RuntimeWarning, match="capture failed"):
        got, engine = decode_steps(model, ids, Dense(), None, backend=_paged(), runner=Broken, steps=24, eos=eos)
    assert engine.graphs.status.startswith("failed") and not engine.engine.cache.backend._graph
    assert torch.equal(got["tokens"], ref["tokens"])


# -- finding 8: graph-mode paged steps for every policy --------------------------------------------
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_paged_graph_step_equals_eager_torch(policy):
    model = tiny_model("qwen3", num_layers=3)
    # 5 rows: with EOS the batch goes 5 -> 4 (bucket) -> 3 live + 1 dummy -> ...
    ids = torch.randint(3, 128, (5, 9), generator=torch.Generator().manual_seed(0))
    for eos in (None, [11, 63]):
        ref, _ = decode_steps(model, ids, policy, 8, backend=TorchBackend(), steps=16, eos=eos)
        got, engine = decode_steps(model, ids, policy, 8, backend=_paged(), runner=EagerRunner, steps=16, eos=eos)
        assert engine.graphs.status == "on" and engine.engine.cache.backend._graph
        assert torch.equal(got["tokens"], ref["tokens"]) and torch.equal(got["lengths"], ref["lengths"])
        torch.testing.assert_close(got["rollout_logp"], ref["rollout_logp"], atol=2e-5, rtol=0)


class _PlanOnly:
    """A kernel that only records its plans and never touches the graph buffers."""

    def __init__(self, **kw):
        self.kw, self.plans = kw, []

    def plan(self, table, *, dtype, scale=None):
        self.plans.append(table)

    def run(self, q, k_pool, v_pool, *, return_lse=True):
        raise AssertionError("not run here")


def test_graph_mode_writes_the_selection_indptr_itself():
    """The sparse table's ``indptr`` buffer is written by the backend, not left to a side
    effect of the kernel's ``plan``."""
    backend = PagedBackend(_PlanOnly, name="plan-only")
    backend.enable_graph(batch=2, heads=3, pages_per_row=5, keep_cap=3, group=2, head_dim=8,
                         device=torch.device("cpu"))
    geo = dict(heads=3, group=2, head_dim=8, pages_per_row=5, page_size=4, dtype=torch.float32, scale=0.5,
               device=torch.device("cpu"))
    backend.begin_step(lengths=torch.tensor([9, 13]), keep=torch.tensor([2, 3]), **geo)
    assert backend._indptr.tolist() == [0, 2, 4, 6, 9, 12, 15]
    assert backend._sparse.kw["graph_buffers"][0] is backend._indptr


def test_reference_kernel_keeps_the_fixed_batch_of_graph_mode():
    backend = _paged()
    backend.enable_graph(batch=2, heads=1, pages_per_row=4, keep_cap=0, group=1, head_dim=4,
                         device=torch.device("cpu"))
    geo = dict(keep=None, heads=1, group=1, head_dim=4, pages_per_row=4, page_size=4, dtype=torch.float32,
               scale=0.5, device=torch.device("cpu"))
    backend.begin_step(lengths=torch.tensor([3, 7]), **geo)
    with pytest.raises(ValueError, match="batch size should be fixed"):
        backend.begin_step(lengths=torch.tensor([3]), **geo)


# -- finding 15: no sparse kernel for non-selection policies, no LSE ---------------------------------
def test_paged_backend_builds_one_kernel_without_selection_and_asks_no_lse():
    calls = []

    class Kernel(ReferenceDecodeKernel):
        def run(self, q, k_pool, v_pool, *, return_lse=True):
            calls.append(return_lse)
            return super().run(q, k_pool, v_pool, return_lse=return_lse)

    made = []
    backend = PagedBackend(lambda **kw: made.append(kw) or Kernel(**kw), name="counting")
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    decode_steps(model, ids, RKV(window=2, buffer=2), 6, backend=backend, steps=4)
    assert len(made) == 1 and backend._sparse is None
    assert calls and not any(calls)
    backend.enable_graph(batch=2, heads=2, pages_per_row=4, keep_cap=0, group=2, head_dim=16,
                         device=torch.device("cpu"))
    assert len(made) == 2 and backend._sparse is None


# -- finding 13: backend="auto" and a broken FlashInfer install ---------------------------------------
def test_auto_falls_back_to_torch_when_flashinfer_fails_to_import(monkeypatch):
    import sparsecorr.decoding.backends as backends

    monkeypatch.setattr(fi, "flashinfer_status", lambda: (True, "ok"))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    monkeypatch.setattr(backends, "_AUTO_WARNED", set())
    with pytest.warns(RuntimeWarning, match="failed to load .*import of flashinfer halted"):
        got = get_backend("auto", device="cuda", dtype=torch.bfloat16)
    assert got.name == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per error
        assert get_backend("auto", device="cuda", dtype=torch.bfloat16).name == "torch"
    with pytest.raises(ImportError):  # asked for by name: no fallback
        get_backend("flashinfer", device="cuda", dtype=torch.bfloat16)


# -- finding 4: host syncs of a paged step --------------------------------------------------------
class _Syncs(TorchDispatchMode):
    """Counts what syncs a GPU host: blocking copies across devices and scalar reads of device
    tensors (here the "device" is ``meta``, so the host/device boundary is visible on CPU)."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else kwargs.get("device", src.device)
            nb = args[2] if name == "copy_" and len(args) > 2 else kwargs.get("non_blocking", False)
            if torch.device(dst) != src.device and not nb:
                self.events.append(f"blocking {name} {src.device}->{dst}")
        if name in ("_local_scalar_dense", "item") and args[0].device.type != "cpu":
            self.events.append(f"{name} on {args[0].device}")
        return func(*args, **kwargs)


class _Recorder:
    def __init__(self, **_):
        self.plans = []

    def plan(self, table, *, dtype, scale=None):
        self.plans.append(table)


@pytest.mark.parametrize("graph", [False, True])
def test_paged_step_planning_makes_no_blocking_copy(graph):
    """One paged step's planning (dense table + selection table) on a non-host device: no
    blocking copy, no device scalar read, and the kernels get ``indptr`` / ``last_page_len`` on
    the host (FlashInfer's ``plan`` would copy device ones back, a sync each)."""
    meta = torch.device("meta")
    backend = PagedBackend(_Recorder, name="rec")
    if graph:
        backend.enable_graph(batch=3, heads=2, pages_per_row=6, keep_cap=4, group=2, head_dim=8, device=meta)
    with _Syncs() as mode:
        backend.begin_step(lengths=torch.tensor([5, 17, 23]), keep=torch.tensor([2, 4, 4]), heads=2, group=2,
                           head_dim=8, pages_per_row=6, page_size=4, dtype=torch.bfloat16, scale=0.3, device=meta)
    assert mode.events == []
    for kernel in (backend._dense, backend._sparse):
        (table,) = kernel.plans
        assert table.indptr.device.type == "cpu" and table.last_page_len.device.type == "cpu"
        assert table.indices.device == meta


def test_flashinfer_plan_hands_host_tables_and_fences_once(monkeypatch):
    """FlashInferDecode with a stand-in ``flashinfer`` module: ``plan`` gets host ``indptr`` /
    ``last_page_len`` and waits on exactly one event per plan, the previous plan's."""
    log = []

    class Wrapper:
        def __init__(self, workspace, layout, **kw):
            pass

        def plan(self, indptr, indices, last_page_len, *args, **kw):
            log.append(("plan", indptr.device.type, last_page_len.device.type))

    class Event:
        def record(self):
            log.append("record")

        def synchronize(self):
            log.append("wait")

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper))
    monkeypatch.setattr(fi, "flashinfer_status", lambda: (True, "ok"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    kernel = fi.FlashInferDecode(device="cpu", group_size=2, head_dim=8, workspace_bytes=16)
    from sparsecorr.decoding.backends.paging import dense_page_table

    table = dense_page_table(torch.tensor([3, 9]), heads=2, pages_per_row=4, page_size=4, device="cpu")
    for _ in range(3):
        kernel.plan(table, dtype=torch.bfloat16)
    assert log == [("plan", "cpu", "cpu"), "record"] + [("wait"), ("plan", "cpu", "cpu"), "record"] * 2


# -- finding 11: a compression moves the budgets to the device once --------------------------------
@pytest.mark.parametrize("policy", [StreamingLLM(sink=1), RKV(window=2, buffer=2)], ids=lambda p: p.name)
def test_compression_makes_no_blocking_copy_per_layer(policy):
    from sparsecorr.decoding.cache import SparseKVCache
    from sparsecorr.decoding.pool import KVPool

    meta = torch.device("meta")
    pool = KVPool(layers=4, batch=3, kv_heads=2, head_dim=8, capacity=24, page_size=16,
                  dtype=torch.float32, device=meta, positions=True, grad=False)
    state = policy.new_state(pool, q_heads=4, table=torch.full((32,), 8))
    cache = SparseKVCache(pool, policy=policy, state=state, backend=TorchBackend())
    with _Syncs() as mode:
        cache.compress(torch.tensor([8, 10, 12]), torch.tensor([11, 13, 12]), torch.tensor([11, 13, 12]))
    assert mode.events == []


# -- finding 10: full, aligned chunks run causal SDPA without a mask tensor ---------------------------
def test_aligned_chunk_attention_equals_the_masked_one():
    from torch.nn.attention.bias import causal_lower_right

    from sparsecorr.decoding.backends import ReferenceBackend

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 16, generator=g), torch.randn(2, 2, 12, 16, generator=g), torch.randn(2, 2, 12, 16, generator=g)
    mask = (torch.arange(12) <= 7 + torch.arange(5)[:, None])[None, None]
    for backend in (TorchBackend(), ReferenceBackend()):
        want = backend.attend(q, k, v, mask, scaling=0.25)
        got = backend.attend(q, k, v, causal_lower_right(5, 12), scaling=0.25)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("policy", [Dense(), RKV(window=2, buffer=4), BlockTopK(page_size=4, dense_layers=1)],
                         ids=lambda p: p.name)
def test_aligned_chunks_give_todays_logprobs(policy, monkeypatch):
    """Equal-length prompts (prefill) and teacher-forced chunks of full rows use the causal
    kernel; log-probs equal those of the explicit [B, 1, Q, S] mask."""
    from torch.nn.attention.bias import CausalBias

    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (3, 10), generator=torch.Generator().manual_seed(6))
    resp = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(7))
    kw = dict(policy=policy, budget=8, backend="torch", prefill_chunk=4, chunk_size=5)
    seen = []
    plan = Engine.plan

    def explicit(self, q_len, real, **kw):
        st = plan(self, q_len, real, **kw)
        if isinstance(st.mask, CausalBias):
            seen.append(q_len)
            counts = self.count.to(self.device)
            mask = (torch.arange(st.kv_len) <= (counts[:, None] + torch.arange(q_len))[:, :, None])[:, None]
            st = dataclasses.replace(st, mask=mask)  # the plan is frozen: the same plan, the explicit mask
        return st

    got = teacher_forced_logprobs(model, ids, resp, **kw)
    monkeypatch.setattr(Engine, "plan", explicit)
    want = teacher_forced_logprobs(model, ids, resp, **kw)
    assert seen  # the aligned path ran
    torch.testing.assert_close(got.rollout_logp, want.rollout_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.topk_logp, want.topk_logp, atol=1e-5, rtol=0)


# -- finding 5: captures are counted and timed -------------------------------------------------------
def test_graph_captures_are_counted_and_timed():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(1))
    fields, engine = decode_steps(model, ids, Dense(), None, backend=TorchBackend(), runner=EagerRunner, steps=24,
                                  eos=[11, 63, 90])
    sizes = {int((fields["lengths"] > t).sum()) for t in range(1, int(fields["lengths"].max()))} - {0}
    assert engine.graphs.captures == len(sizes) > 1  # 3 rows: every size met is its own bucket
    assert engine.graphs.capture_s > 0


# -- finding 1: the GPU tests need no TRL, OpenRLHF or verl -------------------------------------------
@pytest.mark.slow  # ~10 s idle (a fresh interpreter imports tests/gpu); make test-slow (CI) runs it
def test_gpu_tests_import_no_rl_framework():
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    code = ("import sys\nfor m in ('trl', 'openrlhf', 'verl', 'sparsecorr_trl'): sys.modules[m] = None\n"
            "import tests.gpu.test_decoding_gpu, tests.gpu.test_flashinfer_kernel\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
