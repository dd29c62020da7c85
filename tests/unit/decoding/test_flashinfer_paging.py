"""CPU side of the FlashInfer backend: page tables, the paged oracle, availability errors."""

import subprocess
import sys

import pytest
import torch

from sparsecorr.decoding.backends.flashinfer import (
    BackendUnavailableError,
    FlashInferDecode,
    flashinfer_status,
    needs_tensor_cores,
    require_flashinfer,
)
from sparsecorr.decoding.backends.paging import (
    page_table_from_keep,
    page_table_from_mask,
    paged_attention_reference,
)


def _dense_masked(q, k, v, attend):
    """q [B, Hkv, G, D], k/v [B, Hkv, S, D], attend [B, Hkv, S] -> out [B, Hkv, G, D], lse."""
    d = q.shape[-1]
    logits = torch.einsum("bhgd,bhsd->bhgs", q.float(), k.float()) * d**-0.5
    logits = logits.masked_fill(~attend[:, :, None, :], float("-inf"))
    return torch.softmax(logits, -1) @ v.float(), torch.logsumexp(logits, -1)


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kept", ["one", "random", "full"])
def test_token_page_table_reads_exactly_the_kept_set(group, head_dim, kept):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    b, h, s = 2, 3, 20
    q = torch.randn(b, h, group, head_dim, generator=gen)
    k = torch.randn(b, h, s, head_dim, generator=gen)
    v = torch.randn(b, h, s, head_dim, generator=gen)
    if kept == "full":
        index = torch.arange(s).expand(b, h, s).clone()
        valid = torch.ones(b, h, s, dtype=torch.bool)
    else:
        n = 1 if kept == "one" else 7
        index = torch.rand(b, h, s, generator=gen).argsort(-1)[..., :n].sort(-1).values
        valid = torch.ones(b, h, n, dtype=torch.bool)
        if kept == "random":
            valid[0, 1, 4:] = False  # ragged row
    table = page_table_from_keep(index, valid, slots=s)
    attend = torch.zeros(b, h, s, dtype=torch.bool)
    attend.scatter_(2, index, valid)
    pool_k, pool_v = k.reshape(b * h * s, 1, head_dim), v.reshape(b * h * s, 1, head_dim)
    out, lse = paged_attention_reference(q.reshape(b * h, group, head_dim), pool_k, pool_v, table)
    ref_out, ref_lse = _dense_masked(q, k, v, attend)
    torch.testing.assert_close(out, ref_out.reshape(b * h, group, head_dim), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.reshape(b * h, group), atol=1e-5, rtol=1e-5)
    assert table.kv_lengths().tolist() == valid.reshape(b * h, -1).sum(-1).tolist()


@pytest.mark.parametrize("length", [1, 16, 37, 64])
def test_block_page_table_matches_page_mask(length):
    gen = torch.Generator().manual_seed(length)
    b, h, s, d, ps, g = 2, 2, 64, 32, 16, 4
    n_pages = s // ps
    q = torch.randn(b, h, g, d, generator=gen)
    k = torch.randn(b, h, s, d, generator=gen)
    v = torch.randn(b, h, s, d, generator=gen)
    lengths = torch.tensor([length, max(1, length - 5)])
    pages = torch.rand(b, h, n_pages, generator=gen) < 0.5
    pages[..., 0] = True  # first page always kept (Sparrow)
    pos = torch.arange(s)
    last = ((lengths - 1) // ps)[:, None, None]
    pages |= torch.arange(n_pages)[None, None] == last  # the current page
    attend = pages.repeat_interleave(ps, -1) & (pos[None, None] < lengths[:, None, None])
    table = page_table_from_mask(attend, lengths, page_size=ps)
    pool_k = k.reshape(b * h * n_pages, ps, d)
    pool_v = v.reshape(b * h * n_pages, ps, d)
    out, lse = paged_attention_reference(q.reshape(b * h, g, d), pool_k, pool_v, table)
    ref_out, ref_lse = _dense_masked(q, k, v, attend)
    torch.testing.assert_close(out, ref_out.reshape(b * h, g, d), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.reshape(b * h, g), atol=1e-5, rtol=1e-5)
    assert ((table.last_page_len >= 1) & (table.last_page_len <= ps)).all()


def test_page_table_errors():
    with pytest.raises(ValueError, match="page-aligned"):
        mask = torch.zeros(1, 1, 32, dtype=torch.bool)
        mask[..., :5] = True
        page_table_from_mask(mask, torch.tensor([32]), page_size=16)
    with pytest.raises(ValueError, match="beyond the row's length"):
        page_table_from_mask(torch.ones(1, 1, 32, dtype=torch.bool), torch.tensor([20]), page_size=16)
    with pytest.raises(ValueError, match="at least one"):
        page_table_from_keep(torch.zeros(1, 1, 2, dtype=torch.long),
                             torch.zeros(1, 1, 2, dtype=torch.bool), slots=4)
    with pytest.raises(ValueError, match="index/valid"):
        page_table_from_keep(torch.zeros(1, 2, dtype=torch.long),
                             torch.zeros(1, 2, dtype=torch.bool), slots=4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_clear_error_without_cuda():
    ok, reason = flashinfer_status()
    assert not ok and "CUDA" in reason and "backend='torch'" in reason
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        require_flashinfer()
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        FlashInferDecode(device="cpu", group_size=4, head_dim=64)


def test_clear_error_without_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else real(name, *a))
    ok, reason = flashinfer_status()
    assert not ok and "flashinfer-python" in reason and "sparsecorr[flashinfer]" in reason


def test_tensor_cores_for_odd_group_sizes():
    assert needs_tensor_cores(7) and needs_tensor_cores(5)
    assert not any(needs_tensor_cores(g) for g in (1, 2, 4, 8))


def test_flashinfer_never_imported_with_the_package():
    code = (
        "import sys, sparsecorr, sparsecorr.decoding, sparsecorr.decoding.backends.flashinfer;"
        "print('flashinfer' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_generate_asks_for_flashinfer_where_it_cannot_run(monkeypatch):
    from sparsecorr.decoding import RKV, generate
    from sparsecorr.decoding.backends import TorchBackend, get_backend
    from sparsecorr.decoding.backends import flashinfer as fi
    from tests.models import tiny_model

    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
            generate(tiny_model("qwen3"), torch.ones(1, 3, dtype=torch.long), policy=RKV(), budget=8,
                     max_new_tokens=2, backend="flashinfer")
    # pretend FlashInfer can run: the model's device and dtype still decide
    monkeypatch.setattr(fi, "require_flashinfer", lambda: None)
    monkeypatch.setattr(fi, "flashinfer_status", lambda: (True, "ok"))
    with pytest.raises(BackendUnavailableError, match="the model is on cpu"):
        get_backend("flashinfer", device="cpu")
    with pytest.raises(BackendUnavailableError, match="bf16 or fp16"):
        get_backend("flashinfer", device="cuda", dtype=torch.float32)
    assert get_backend("flashinfer", device="cuda", dtype=torch.bfloat16).name == "flashinfer"
    assert get_backend("auto", device="cuda", dtype=torch.bfloat16).name == "flashinfer"
    assert isinstance(get_backend("auto", device="cuda", dtype=torch.float32), TorchBackend)
    assert isinstance(get_backend("auto", device="cpu", dtype=torch.bfloat16), TorchBackend)
