"""A pool retired by a capture that failed part way (``_capture.Pool.retired``: the allocator may
still take it for one being recorded to) is never handed to another capture: the callable's,
the region's and the share group's ``pool()`` make a new one; the graphs already in the old one
keep it. CPU: the owners' bookkeeping with a backend whose pools are ``Pool`` objects (the
GPU half: tests/test_gpu_faults.py)."""

from __future__ import annotations

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._capture import Pool
from cudagraphify._region import GraphRegion
from cudagraphify._share import ShareGroup
from cudagraphify.api import _state_of

DEV = torch.device("cpu")


class _Pools:
    """new_pool() as CudaBackend's: a fresh Pool each time."""

    def __init__(self):
        self.made: list[Pool] = []

    def new_pool(self, device):
        pool = Pool((0, len(self.made) + 1))
        self.made.append(pool)
        return pool


def _retires(get):
    backend = _Pools()
    first = get(backend)
    assert get(backend) is first and len(backend.made) == 1  # (kept while usable)
    first.retired = True
    second = get(backend)
    assert second is not first and not second.retired and len(backend.made) == 2
    assert get(backend) is second


def test_a_callables_pool_is_made_again_once_retired(sim):
    g = cg.graphify(nn.Linear(2, 2))
    with torch.no_grad():
        g(torch.randn(3, 2))  # (its state is made by the first call)
    state = _state_of(g)
    _retires(lambda backend: state.pool(backend, DEV))


def test_a_regions_pool_is_made_again_once_retired():
    region = GraphRegion()
    _retires(lambda backend: region.pool(backend, DEV))


def test_a_share_groups_pool_is_made_again_once_retired():
    group = ShareGroup([nn.Linear(2, 2), nn.Linear(2, 2)], (), False)
    _retires(lambda backend: group.pool(backend, DEV))


def test_a_pool_is_not_retired_by_default_and_a_plain_tuple_has_no_flag():
    assert not Pool((0, 1)).retired
    assert not getattr((0, 1), "retired", False)
