"""FlashInfer kernel parity against the float32 paged oracle (needs CUDA + flashinfer-python).

Run on a GPU machine with ``make test-gpu`` (``pytest -m gpu``). Skipped elsewhere.
"""

import importlib.util

import pytest
import torch

from sparsecorr.decoding.backends.paging import (
    page_table_from_keep,
    page_table_from_mask,
    paged_attention_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="needs flashinfer-python"),
]

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kept", [1, 100, 512])
def test_token_level_kernel_parity(dtype, group, head_dim, kept):
    from sparsecorr.decoding.backends.flashinfer import FlashInferDecode

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    b, h, s = 4, 2, 512
    k = torch.randn(b * h * s, 1, head_dim, generator=gen, device=dev, dtype=dtype)
    v = torch.randn(b * h * s, 1, head_dim, generator=gen, device=dev, dtype=dtype)
    q = torch.randn(b * h, group, head_dim, generator=gen, device=dev, dtype=dtype)
    index = torch.rand(b, h, s, generator=gen, device=dev).argsort(-1)[..., :kept].sort(-1).values
    table = page_table_from_keep(index, torch.ones_like(index, dtype=torch.bool), slots=s)
    fi = FlashInferDecode(device=dev, group_size=group, head_dim=head_dim)
    fi.plan(table, dtype=dtype)
    out, lse = fi.run(q, k, v)
    ref_out, ref_lse = paged_attention_reference(q, k, v, table)
    torch.testing.assert_close(out.float(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 7])
def test_block_kernel_parity(dtype, group):
    from sparsecorr.decoding.backends.flashinfer import FlashInferDecode

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    b, h, s, d, ps = 2, 2, 1024, 128, 16
    n_pages = s // ps
    lengths = torch.tensor([1000, 777], device=dev)
    pages = torch.rand(b, h, n_pages, generator=gen, device=dev) < 0.3
    pages[..., 0] = True
    pages |= torch.arange(n_pages, device=dev)[None, None] == ((lengths - 1) // ps)[:, None, None]
    attend = pages.repeat_interleave(ps, -1) & (
        torch.arange(s, device=dev)[None, None] < lengths[:, None, None])
    table = page_table_from_mask(attend, lengths, page_size=ps)
    k = torch.randn(b * h * n_pages, ps, d, generator=gen, device=dev, dtype=dtype)
    v = torch.randn(b * h * n_pages, ps, d, generator=gen, device=dev, dtype=dtype)
    q = torch.randn(b * h, group, d, generator=gen, device=dev, dtype=dtype)
    fi = FlashInferDecode(device=dev, group_size=group, head_dim=d)
    fi.plan(table, dtype=dtype)
    out, _ = fi.run(q, k, v)
    ref_out, _ = paged_attention_reference(q, k, v, table)
    torch.testing.assert_close(out.float(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
