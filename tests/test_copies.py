"""Unit tests of cudagraphify/_copies.py's small helpers: which layouts overlap themselves,
when ``clone()`` keeps a tensor as eager has it, and ``copy_of``."""

from __future__ import annotations

import pytest
import torch

from cudagraphify._copies import clone_keeps, copy_of, overlaps

_BASE = torch.arange(40.0)


@pytest.mark.parametrize("size, stride, want", [
    ((2, 3), (3, 1), False),  # contiguous
    ((3, 2), (1, 3), False),  # transposed
    ((4,), (0,), True),  # expanded
    ((3, 3), (2, 1), True),  # rows that share an element: torch's check says "too hard"
    ((2, 2), (3, 1), False),  # gaps between rows: torch's "too hard" again, no overlap
    ((2, 3, 2), (1, 4, 2), False),  # interleaved strides that tile the memory
])
def test_overlaps_answers_where_torchs_check_gives_up(size, stride, want):
    t = _BASE.as_strided(size, stride)
    assert overlaps(t) is want
    # (the answer, checked element by element)
    idx = torch.arange(40).as_strided(size, stride).flatten().tolist()
    assert (len(set(idx)) < len(idx)) is want


def test_clone_keeps_only_dense_tensors_without_bits():
    assert clone_keeps(_BASE[:6].view(2, 3).t())  # dense, strides kept by clone
    assert not clone_keeps(_BASE[:12].view(3, 4)[:, ::2])  # gaps: a clone is contiguous
    assert not clone_keeps(_BASE[:1].expand(4))
    assert not clone_keeps(torch.randn(3, dtype=torch.complex64).conj())


def test_copy_of_is_eagers_tensor_on_new_memory():
    for t in (_BASE[:6].view(2, 3).t(), _BASE[:12].view(3, 4)[:, ::2]):
        c = copy_of(t, t.untyped_storage().data_ptr())
        assert torch.equal(c, t) and c.stride() == t.stride() and c.dtype == t.dtype
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
