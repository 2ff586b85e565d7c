"""share_graph with a cache passed as it is (an HF StaticCache): each layer's graph, made from
one template, reads and writes its own part of the cache.

CPU, through the graph-reading double of tests/test_share_engine.py. ``ideal_pool`` reads
each capture's allocations at addresses in allocation order, as a CUDA graph pool lays the
same work out alike from one memory state (measured on the H100: .ci/diag/same_pool.py);
plain ``reading`` has the CPU allocator's addresses, which do not repeat. Every step compares
outputs and every cache tensor with an eager twin, bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _share
from cudagraphify._cugraph import GraphNode
from cudagraphify._graphdiff import RebasePlan, Refused
from test_review_static_state import Cache, StaticLayer
from test_share_engine import _register, ideal_pool, reading  # noqa: F401 - fixtures


class Layer(nn.Module):
    """An HF decoder layer in small: its ``layer_idx`` picks its part of the cache."""

    def __init__(self, idx: int):
        super().__init__()
        self.layer_idx = idx
        self.proj = nn.Linear(16, 16)

    def forward(self, x, past_key_values=None, pos=None):
        keys = past_key_values.layers[self.layer_idx].update(self.proj(x), pos)
        return x + keys.mean(1, keepdim=True)


class Picky(Layer):
    """Its ``layer_idx`` also picks one of two intermediates the same kernels made."""

    def forward(self, x, past_key_values=None, pos=None):
        h = self.proj(x)
        h = (h * 2, h * 3)[self.layer_idx % 2]
        keys = past_key_values.layers[self.layer_idx].update(h, pos)
        return x + keys.mean(1, keepdim=True)


class Accumulating(StaticLayer):
    """A cache part written so that writing it twice gives another value (``+=``)."""

    def update(self, k, pos):
        if not self.is_initialized:
            self.keys = torch.zeros(k.shape[0], self.max_len, k.shape[-1], dtype=k.dtype)
            self.is_initialized = True
        self.keys.index_add_(1, pos, k)
        return self.keys


class Model(nn.Module):
    def __init__(self, n: int = 4, layer=Layer):
        super().__init__()
        self.layers = nn.ModuleList([layer(i) for i in range(n)])

    def forward(self, x, cache, pos):
        for layer in self.layers:
            x = layer(x, past_key_values=cache, pos=pos)
        return x


def _twins(n: int = 4, layer=Layer):
    torch.manual_seed(0)
    ref = Model(n, layer).eval()
    model = copy.deepcopy(ref)
    _register(model)
    return ref, model, cg.share_graph(model.layers)


def _decode(ref, model, caches, steps: int = 5, start: int = 0):
    """``steps`` calls of both twins, each with its own cache; asserts bitwise equality."""
    (rc, c), n = caches, len(ref.layers)
    with torch.no_grad():
        for t in range(start, start + steps):
            x, pos = torch.randn(1, 1, 16), torch.tensor([t])
            assert torch.equal(model(x, c, pos), ref(x, rc, pos)), t
            for i in range(n):
                assert torch.equal(c.layers[i].keys, rc.layers[i].keys), (t, i)


def _caches(n: int = 4, part=StaticLayer):
    return Cache([part() for _ in range(n)]), Cache([part() for _ in range(n)])


def test_layers_share_one_template_each_with_its_own_part_of_the_cache(ideal_pool):
    ref, model, group = _twins()
    _decode(ref, model, _caches())
    s = group.stats()
    # the first call sets the cache up (eager); then every layer's graph comes from layer 0's
    assert (s.retargets, s.per_layer) == (4, 0), s.reasons
    assert [cg.stats(layer).replays for layer in model.layers] == [3, 3, 3, 3]
    assert all(n > 0 for n in s.rebased_slots.values())


def test_a_layer_whose_index_picks_an_intermediate_is_refused(ideal_pool):
    # layer 1 and 3 use h * 3 where layer 0 used h * 2: the same kernels, other intermediates
    # (only the pool addresses tell); 2 takes layer 0's path and shares
    ref, model, group = _twins(layer=Picky)
    _decode(ref, model, _caches())
    s = group.stats()
    refused = [r for r in s.reasons if "in one memory state" in r]
    assert s.per_layer == 2 and len(refused) == 2, s.reasons
    assert any("layer 1 read values" in r for r in refused)
    assert any("layer 3 read values" in r for r in refused)
    assert s.retargets == 2


def test_where_captures_do_not_lay_memory_out_alike_layers_reading_their_index_are_refused(
        reading):
    # (the CPU allocator's addresses: no proof that the intermediates are the same ones)
    ref, model, group = _twins()
    _decode(ref, model, _caches())
    s = group.stats()
    assert s.retargets == 1 and s.per_layer == 3, s.reasons
    assert all("in one memory state" in r for r in s.reasons)


def test_a_part_written_so_that_a_second_write_differs_is_left_as_eager_left_it(ideal_pool):
    # the template's replays, the partner's run and each layer's check would add the key again
    ref, model, group = _twins()
    _decode(ref, model, _caches(part=Accumulating))
    assert group.stats().retargets == 4


def test_a_new_cache_gets_graphs_of_its_own(ideal_pool):
    ref, model, group = _twins()
    _decode(ref, model, _caches())
    _decode(ref, model, _caches())  # (another generate(), with a new cache)
    s = group.stats()
    assert s.retargets == 8 and s.per_layer == 0, s.reasons


def test_the_template_keeps_no_cache_alive(ideal_pool):
    import gc
    import weakref

    ref, model, group = _twins()
    caches = _caches()
    _decode(ref, model, caches)
    gone = weakref.ref(caches[1])
    del caches
    gc.collect()
    assert group.stats().retargets == 4
    assert gone() is None or all(
        getattr(t, "call", None) is None for t in group._templates.values())


def test_a_cache_passed_with_static_argnames_is_not_shared(ideal_pool):
    torch.manual_seed(0)
    ref = Model().eval()
    model = copy.deepcopy(ref)
    _register(model)
    group = cg.share_graph(model.layers, static_argnames=("past_key_values",))
    _decode(ref, model, _caches())
    s = group.stats()
    assert s.retargets == 0 and all("static_argnames" in r for r in s.reasons), s.reasons


def _node(*words: int, name: str = "k") -> GraphNode:
    return GraphNode(0, (0, name, ()), [b"".join(w.to_bytes(8, "little") for w in words)], name)


def test_two_captures_that_place_an_intermediate_differently_are_refused():
    pool = [(1 << 40, 1 << 20)]
    p = pool[0][0]
    _share._same_memory([_node(p, 5)], [_node(p, 7)], pool)  # (a scalar: not memory)
    _share._same_memory([_node(p, 0x1234)], [_node(p, 0x5678)], pool)  # (outside the pool)
    with pytest.raises(Refused, match="placed an intermediate differently"):
        _share._same_memory([_node(p, 1)], [_node(p + 64, 1)], pool)


def test_the_slots_of_a_plan():
    plan = RebasePlan(slots={2: {0: [(0, 1, 0), (16, 0, 8)]}})
    assert _share._slots(plan) == {(2, 0, 0, 1, 0), (2, 0, 16, 0, 8)}
    assert _share._slots(None) == set()
