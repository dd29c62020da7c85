"""Backend ``"auto"`` chooses by what FlashInfer's kernels support (head_dim, dtype, GQA group),
records why in ``meta["backend"]``, and an explicit ``"flashinfer"`` for a shape its kernels are
not built for is a ``ValueError``. On the CPU: a fake CUDA device and a fake-installed FlashInfer
(its status and import patched), as in ``test_flashinfer_paging.py``."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsecorr.decoding import RKV, generate
from sparsecorr.decoding.backends import TorchBackend, get_backend, select_backend
from sparsecorr.decoding.backends import flashinfer as fi
from sparsecorr.decoding.backends.flashinfer import (
    FLASHINFER_DTYPES,
    FLASHINFER_HEAD_DIMS,
    BackendUnavailableError,
    flashinfer_supports,
)
from tests.models import tiny_model

BF16 = torch.bfloat16
generate_mod = importlib.import_module("sparsecorr.decoding.generate")  # the package's ``generate`` is the function


@pytest.mark.parametrize(("head_dim", "dtype", "group_size", "reason"), [
    (64, BF16, 1, None),
    (128, torch.float16, 7, None),  # an odd group: the tensor-core kernel, still supported
    (128, BF16, 8, None),
    (256, BF16, 4, None),
    (16, BF16, 2, "head_dim 16 (its kernels are built for 64, 128, 256)"),
    (96, BF16, 2, "head_dim 96"),
    (512, BF16, 2, "head_dim 512"),
    (128, torch.float32, 2, "dtype torch.float32 (its kernels take torch.bfloat16 or torch.float16)"),
    (128, BF16, 0, "group_size 0"),
    (128.0, BF16, 2, "head_dim 128.0"),
    (True, BF16, 2, "head_dim True"),
])
def test_the_rule(head_dim, dtype, group_size, reason):
    got = flashinfer_supports(head_dim=head_dim, dtype=dtype, group_size=group_size)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith("FlashInfer does not support ") and reason in got


@given(head_dim=st.integers(1, 1024), half=st.booleans(), group_size=st.integers(-2, 64),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, BF16]))
def test_the_rule_is_the_table(head_dim, half, group_size, dtype):
    ok = head_dim in FLASHINFER_HEAD_DIMS and dtype in FLASHINFER_DTYPES and group_size >= 1
    assert (flashinfer_supports(head_dim=head_dim, dtype=dtype, group_size=group_size) is None) == ok


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInfer "installed and importable"; the backend object is built without the package."""
    monkeypatch.setattr(fi, "flashinfer_status", lambda: (True, "ok"))
    monkeypatch.setattr(fi, "require_flashinfer", lambda: None)


def test_auto_on_cuda_picks_flashinfer_only_where_supported(fake_flashinfer):
    back, label = select_backend("auto", device="cuda", dtype=BF16, head_dim=128, group_size=2)
    assert back.name == "flashinfer" and label == "flashinfer"
    back, label = select_backend("auto", device="cuda", dtype=BF16, head_dim=16, group_size=2)
    assert isinstance(back, TorchBackend)
    assert label == "torch (auto: FlashInfer does not support head_dim 16 (its kernels are built for 64, 128, 256))"
    back, label = select_backend("auto", device="cuda", dtype=torch.float32, head_dim=128, group_size=2)
    assert isinstance(back, TorchBackend) and "dtype torch.float32" in label
    # off CUDA nothing needs saying
    assert select_backend("auto", device="cpu", dtype=BF16, head_dim=16, group_size=2)[1] == "torch"
    # no shape given: the dtype alone decides, as before
    assert get_backend("auto", device="cuda", dtype=BF16).name == "flashinfer"


def test_auto_on_cuda_without_the_package_says_so(monkeypatch):
    monkeypatch.setattr(fi, "flashinfer_status", lambda: (False, "not installed"))
    back, label = select_backend("auto", device="cuda", dtype=BF16, head_dim=128, group_size=2)
    assert isinstance(back, TorchBackend) and label == "torch (auto: flashinfer-python is not installed)"


def test_flashinfer_by_name_refuses_an_unsupported_shape(fake_flashinfer):
    with pytest.raises(ValueError, match=r"backend='flashinfer': FlashInfer does not support head_dim 16 "
                                         r"\(its kernels are built for 64, 128, 256\)"):
        get_backend("flashinfer", device="cuda", dtype=BF16, head_dim=16, group_size=2)
    with pytest.raises(ValueError, match="group_size 0"):
        get_backend("flashinfer", device="cuda", dtype=BF16, head_dim=128, group_size=0)
    with pytest.raises(BackendUnavailableError, match="bf16 or fp16"):  # the dtype: as before
        get_backend("flashinfer", device="cuda", dtype=torch.float32, head_dim=16, group_size=2)
    assert get_backend("flashinfer", device="cuda", dtype=BF16, head_dim=256, group_size=7).name == "flashinfer"


def _on_fake_cuda(monkeypatch, seen: list):
    """`generate` selects its backend as for a CUDA model (the decode itself runs on the CPU)."""
    real = generate_mod.select_backend

    def select(name, *, device, **kw):
        seen.append(kw)
        return real(name, device="cuda", **kw)

    monkeypatch.setattr(generate_mod, "select_backend", select)


def test_generate_records_why_auto_took_torch(fake_flashinfer, monkeypatch):
    model = tiny_model("qwen3", head_dim=16, num_heads=4, num_kv_heads=2, dtype=BF16)
    ids = torch.ones(1, 3, dtype=torch.long)
    assert generate(model, ids, policy=RKV(), budget=8, max_new_tokens=2).meta["backend"] == "torch"  # CPU
    seen: list = []
    _on_fake_cuda(monkeypatch, seen)
    out = generate(model, ids, policy=RKV(), budget=8, max_new_tokens=2)
    assert seen == [dict(dtype=BF16, head_dim=16, group_size=2)]  # the model's own shape
    assert out.meta["backend"].startswith("torch (auto: FlashInfer does not support head_dim 16")
    with pytest.raises(ValueError, match="head_dim 16"):
        generate(model, ids, policy=RKV(), budget=8, max_new_tokens=2, backend="flashinfer")
