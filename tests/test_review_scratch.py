"""Review of d357f7a (a region graph whose capture freed no block and made no tensor but its
outputs, ``scratch == False``, leaves slots captured after it unprotected).

On the CPU double (``sim``) a capture frees nothing that a later capture could be given, so no
value goes wrong here: the findings assert the classification (``entry.scratch``) against what
the graph's capture wrote (the storages the double saw made by its ops: ``fresh``). The
double's graphs report no counts; each test sets those a CUDA capture would report.

SCR-1 (fixed since): where the CUDA allocator keeps no counts (``backend:cudaMallocAsync``,
whose ``memory_stats()`` lists every core stat as 0), its frees read 0, not None, so only the
probe decided; the probe sees the tensors an op returns, not those it makes inside
(``F.layer_norm``'s mean and rstd, autocast's casts, copies inside a composite op). The counts
are now read from the native allocator only, and the blocks handed out while captured must be
as many as the storages the probe saw made.

Controls: what the classification gets right on the paths the brief lists.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture
from cudagraphify._signature import storage_of


def _sim_graphs_record_fresh(sim, monkeypatch, frees):
    """The double's graphs report ``frees`` and, as the CUDA backend counts them, the blocks
    their capture's ops made (``allocs``: the storages the double saw made, ``fresh``); None:
    no count, as the double's own graphs."""
    capture = type(sim).capture

    def counted(self, *a, **k):
        raw, out = capture(self, *a, **k)
        if frees is not None:
            raw.allocs, raw.frees = len(raw.fresh), frees
        return raw, out
    monkeypatch.setattr(type(sim), "capture", counted)


def _entry(region, g):
    (entry,) = region.cache_for(g._cudagraphify_state).graphs()
    return entry


def _beyond_outputs(entry) -> int:
    """Bytes of the storages the capture's ops made that are no output's storage."""
    outs = {storage_of(t) for t in entry.output_tensors()}
    fresh = [h.untyped_storage() for h in entry.raw.fresh]  # (the double holds tensors on them)
    return sum(s.nbytes() for s in fresh if s.data_ptr() not in outs)


class _Norm(nn.Module):
    """One visible op, ``F.layer_norm``: inside it, ``native_layer_norm`` makes mean and rstd,
    freed before it returns (on CUDA: temporaries of the graph's pool)."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],))


class _Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class _Tmp(nn.Module):
    """A visible temporary (``relu``'s output), freed in the forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).relu() + 1


_KEPT: list = []


class _Kept(_Lin):
    """A tensor it makes outlives the forward (kept in a module-level list, not returned)."""

    def forward(self, x):
        y = self.lin(x)
        _KEPT.append(y * 2)
        return y


class _Offset(_Lin):
    """Its output is a view at an offset of what it made: the whole storage is the output's."""

    def forward(self, x):
        return self.lin(x)[1:]


class _Mut(_Lin):
    """Writes its argument in place (copied in and back around each replay)."""

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


def _captured(modules, frees, sim, monkeypatch, x=None):
    """Graph each module in one region (one call each) and return (region, graphed, entries);
    the region stays entered: the caller leaves it (``__exit__``)."""
    _sim_graphs_record_fresh(sim, monkeypatch, frees)
    graphed = [cg.graphify(copy.deepcopy(m)) for m in modules]
    region = cg.graph_region()
    region.__enter__()
    with torch.no_grad():
        for g in graphed:
            g(torch.randn(4, 8) if x is None else x)
    return region, graphed, [_entry(region, g) for g in graphed]


# -- SCR-1 ---------------------------------------------------------------------------------

def _async_backend_stats(monkeypatch):
    """``torch.cuda.memory_stats()`` as the cudaMallocAsync backend gives it: every core stat
    listed, those it does not keep at 0 (CUDAMallocAsyncAllocator::getDeviceStats leaves the
    native allocator's stats zeroed)."""
    stats = {f"{k}.{p}.{m}": 0 for k in ("allocation", "segment", "active", "inactive_split")
             for p in ("all", "large_pool", "small_pool")
             for m in ("current", "peak", "allocated", "freed")}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "cudaMallocAsync")


def test_scr1_an_allocator_keeping_no_counts_counts_nothing(sim, monkeypatch):
    """SCR-1 (fixed since): cudaMallocAsync lists the core stats at 0; its counts were read as
    "no block freed". They are not read there now (``_capture._alloc_counts`` is None), and a
    graph with no count keeps protecting the slots captured after it."""
    _async_backend_stats(monkeypatch)
    assert _capture._alloc_counts() is None
    region, _, (norm,) = _captured([_Norm()], None, sim, monkeypatch)
    try:
        assert _beyond_outputs(norm) == 32 and norm.scratch, (norm.frees, norm.allocs)
    finally:
        region.__exit__(None, None, None)


def test_control_the_native_count_is_what_sees_an_ops_own_temporaries(sim, monkeypatch):
    """The probe sees F.layer_norm's output only: the native allocator's counts see mean and
    rstd, made (3 blocks for the 1 storage the probe saw) and freed while captured, and the
    graph keeps protecting the slots captured after it; with neither count it would not."""
    for frees in (2, 0):
        region, _, (norm,) = _captured([_Norm()], frees, sim, monkeypatch)
        try:
            assert _beyond_outputs(norm) == 32
            assert norm.allocs == 3 and norm.scratch, (frees, norm.allocs, norm.scratch)
        finally:
            region.__exit__(None, None, None)
        monkeypatch.undo()


# -- controls --------------------------------------------------------------------------------

def test_control_a_graph_that_makes_only_its_outputs(sim, monkeypatch):
    region, _, (lin, off) = _captured([_Lin(), _Offset()], 0, sim, monkeypatch)
    try:
        for e in (lin, off):
            assert _beyond_outputs(e) == 0 and not e.scratch, e.scratch
        # (an output at an offset: the storage it views is all the graph made, held by it)
        (out,) = off.output_tensors()
        assert out.storage_offset() > 0
    finally:
        region.__exit__(None, None, None)


@pytest.mark.parametrize("module", [_Tmp, _Kept])
def test_control_a_tensor_made_besides_the_outputs_keeps_the_protection(
        sim, monkeypatch, module):
    """With no block freed (``frees == 0``), a tensor the forward made and did not return, freed
    in the forward (``_Tmp``) or kept after it (``_Kept``, to be freed when its holder lets it
    go, after the capture), keeps the old rule."""
    region, _, (e,) = _captured([module()], 0, sim, monkeypatch)
    try:
        assert _beyond_outputs(e) > 0
        assert e.scratch
    finally:
        region.__exit__(None, None, None)
        _KEPT.clear()


def test_control_a_slot_captured_later_is_left_alone_and_still_protected_by_its_own_graph(
        sim, monkeypatch, slot_moves):
    """``a`` (one Linear, scratch False) replays while ``c``'s output (captured after it) is
    held: it is not moved, ``_live_top`` keeps it live, and ``c``'s own next replay moves it."""
    moved = slot_moves
    torch.manual_seed(0)
    ra, rc = _Lin(), _Tmp()
    region, (ga, gc), (a, c) = _captured([ra, rc], 0, sim, monkeypatch)
    try:
        assert a.seq < c.seq and not a.scratch and c.scratch
        with torch.no_grad():
            for _ in range(4):
                x, xc = torch.randn(4, 8), torch.randn(4, 8)
                held = gc(xc)
                for _ in range(3):  # (the fast path's replays too)
                    assert torch.equal(ga(x), ra(x))
                assert not moved[c.seq] and region._live_top >= c.seq
                assert torch.equal(held, rc(xc))
                before = held.clone()
                again = gc(torch.randn(4, 8))  # c's own replay: ``held`` moved first
                assert torch.equal(held, before) and not torch.equal(again, before)
                assert moved[c.seq] >= 1
                moved.clear()
                del again
        assert cg.stats(ga).replays >= 12 and cg.stats(gc).replays >= 8
    finally:
        region.__exit__(None, None, None)


def test_control_a_graph_writing_its_argument_copies_back_into_a_later_slot(sim, monkeypatch):
    """``m`` (scratch False) writes its argument in place; passed ``c``'s output (a slot
    captured after it, not protected before ``m``'s replay), it writes it as eager does."""
    torch.manual_seed(0)
    rm, rc = _Mut(), _Tmp()
    region, (gm, gc), (m, c) = _captured([rm, rc], 0, sim, monkeypatch)
    try:
        assert m.seq < c.seq and not m.scratch and m.mutated
        with torch.no_grad():
            for _ in range(3):
                xc = torch.randn(4, 8)
                y = gc(xc)
                want_in = rc(xc)
                got = gm(y)
                assert torch.equal(got, rm(want_in)) and torch.equal(y, want_in)
        assert cg.stats(gm).replays >= 3
    finally:
        region.__exit__(None, None, None)


def test_control_templates_and_unprobed_graphs_keep_the_old_rule(sim, monkeypatch):
    """``probe=False``: what the forward made is unknown; a graph of the double: no count."""
    region, _, (lin,) = _captured([_Lin()], None, sim, monkeypatch)
    try:
        assert lin.frees is None and lin.scratch
    finally:
        region.__exit__(None, None, None)
    monkeypatch.undo()
    _sim_graphs_record_fresh(sim, monkeypatch, 0)
    g = cg.graphify(_Lin(), probe=False)
    with torch.no_grad(), cg.graph_region() as region:
        g(torch.randn(4, 8))
        e = _entry(region, g)
        assert e.frees == 0 and e.scratch
