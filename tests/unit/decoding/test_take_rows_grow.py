"""`pool.take_rows` gathers rows of a stacked ``[L, B, ...]`` buffer in its own storage: shrinking
(as rows leave a batch) and growing back (as a scheduler admits rows into the pool it allocated
once) both equal ``index_select`` and keep the storage; growing past the storage allocates."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecorr.decoding.pool import take_rows


@settings(max_examples=40, deadline=None)
@given(data=st.data(), layers=st.integers(1, 4), batch=st.integers(1, 7), width=st.integers(1, 5))
def test_shrink_then_grow_equals_index_select_in_the_same_storage(data, layers, batch, width):
    full = torch.randn(layers, batch, width, 3)
    ref = full.clone()
    first = data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch))
    small = take_rows(full, torch.tensor(first))
    assert torch.equal(small, ref[:, first])
    assert small.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    second = data.draw(st.lists(st.integers(0, len(first) - 1), min_size=1, max_size=batch))
    grown = take_rows(small, torch.tensor(second))
    assert torch.equal(grown, ref[:, [first[i] for i in second]])
    assert grown.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    assert grown.is_contiguous() and grown.shape == (layers, len(second), width, 3)


def test_growing_past_the_storage_allocates():
    full = torch.randn(2, 3, 4)
    grown = take_rows(full, torch.tensor([0, 1, 2, 2]))
    assert torch.equal(grown, full[:, [0, 1, 2, 2]])
    assert grown.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
