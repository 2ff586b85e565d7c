"""Review of 9a4c9c3 (a capture that reads a slot in place counts its references once its
probe's notes are let go) and of the slot use counts around it: a slot's ``baseline`` must be
exactly the references cudagraphify holds on its memory; one too high lets a replay overwrite
an alias the caller still holds. On the CPU double, against an eager twin, bitwise.

Findings (SLOT-N, each fixed since: sibling slots take their first baseline together, the
young garbage is collected before a baseline or a borrowing capture's count is read) and
controls that came out right.

The garbage-cycle tests keep the collector off while the root runs, as ``CudaBackend.capture``
does for the capture itself (``_capture._gc_hold``), and collect after each call: on a GPU the
cycles made by a capture's run are alive when the counts are taken, and go at some later
collection."""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def _collector_off():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        if was:
            gc.enable()


def _pair(cls, **options):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref), **options)


def _borrows(root, piece) -> bool:
    """Whether ``piece`` has a graph in ``root``'s region that reads a slot in place."""
    chain = root._cudagraphify_state._chain
    state = piece._cudagraphify_state
    return any(e.borrowed for c in chain.cache_of(state) for e in c.graphs())


def _same(got, want) -> bool:
    pairs = [(got, want)] if isinstance(got, torch.Tensor) else zip(got, want)
    return all(torch.equal(a, b) for a, b in pairs)


def _calls(ref, g, n=8, collect=False):
    """``n`` calls of both twins; the indices of the calls whose outputs differ."""
    bad = []
    with torch.no_grad():
        for i in range(n):
            x = torch.randn(4, 8)
            with _collector_off() if collect else contextlib.nullcontext():
                got = g(x)
            if not _same(got, ref(x)):
                bad.append(i)
    return bad


# -- SLOT-1: two outputs of one graph on one memory ------------------------------------------

class _RowsOf(nn.Module):
    """Two outputs on one memory: the second's rows are the first's rows from 1 on."""

    def __init__(self, chunks=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.chunks = chunks

    def forward(self, x):
        y = self.lin(x)
        if self.chunks:
            return y[:2], y[2:]  # (apart: nothing of the one is the other's)
        return y, y[1:]


class _Siblings(nn.Module):
    """``h`` reads g's second output in place (``b1``), then is called with another tensor
    (``b2``): copied into that output's memory while ``a1`` still lies there."""

    chunks = False

    def __init__(self):
        super().__init__()
        self.g = _RowsOf(self.chunks)
        self.h = nn.Linear(8, 8)

    def forward(self, x):
        a1, a2 = self.g(x)
        if a1.sum().item() > 1e9:  # a host sync: the root runs piecewise
            a1 = a1 * 0
        b1 = self.h(a2)
        b2 = self.h(torch.cat((x, x))[: a2.shape[0]] * 2)
        return a1, b1, b2


class _ChunkSiblings(_Siblings):
    chunks = True


class _ChunkView(_Siblings):
    """Chunks apart; the first dropped, a view of the second held across h's copy-in."""

    chunks = True

    def forward(self, x):
        a1, a2 = self.g(x)
        if a1.sum().item() > 1e9:
            a2 = a2 * 0
        del a1
        v = a2[:1]
        b1 = self.h(a2)
        b2 = self.h(torch.cat((x, x))[: a2.shape[0]] * 2)
        return v, b1, b2


# SLOT-1 (fixed since): the second output on one memory takes its lazy baseline (Slot.hand_out)
# while the first output's fresh alias is in outs: one too high; h's copy-in protects only the
# slot it reads (extra 1: a2, moved), and overwrites a1, which the walk skips (captured before)
def test_a_copy_into_a_borrowed_slot_leaves_a_sibling_outputs_alias_alone(sim):
    ref, g = _pair(_Siblings)
    bad = _calls(ref, g, 6)
    gs, hs = cg.stats(g.g), cg.stats(g.h)
    assert gs.replays >= 1 and hs.replays >= 2 and _borrows(g, g.h), (gs, hs)
    assert bad == [], f"calls {bad}: a1 overwritten by h's copy-in"


# SLOT-1 (fixed since): the same one-too-high baseline with chunks apart: h's copy-in sees one
# extra reference (a2 and its view v are two), moves a2, and overwrites v
def test_a_copy_into_a_borrowed_chunk_leaves_a_view_of_it_alone(sim):
    ref, g = _pair(_ChunkView)
    bad = _calls(ref, g, 6)
    hs = cg.stats(g.h)
    assert hs.replays >= 2 and _borrows(g, g.h), hs
    assert bad == [], f"calls {bad}: v overwritten by h's copy-in"


def test_a_copy_into_a_borrowed_chunk_leaves_the_other_chunk_alone(sim):
    """Control: the same with chunks that do not overlap (the copy-in writes the second's
    memory only)."""
    ref, g = _pair(_ChunkSiblings)
    assert _calls(ref, g, 6) == []
    hs = cg.stats(g.h)
    assert hs.replays >= 2 and _borrows(g, g.h), hs


class _TwiceRows(nn.Module):
    """g called twice, the second output of the first call held across the second call."""

    def __init__(self):
        super().__init__()
        self.g = _RowsOf()

    def forward(self, x):
        a1, a2 = self.g(x)
        if a1.sum().item() > 1e9:
            a1 = a1 * 0
        del a1
        c1, c2 = self.g(x * 2)
        return a2, c1, c2


def test_a_sibling_slots_alias_is_protected_by_its_own_graphs_walk(sim):
    """Control: g's own replay walks both slots; the first's exact baseline covers a2."""
    ref, g = _pair(_TwiceRows)
    assert _calls(ref, g, 6) == []
    assert cg.stats(g.g).replays >= 4, cg.stats(g.g)


# -- SLOT-2, SLOT-3: garbage cycles made by a capture's run ----------------------------------

class _CycleHalves(nn.Module):
    """A rotary ``rotate_half`` with a recursive local helper: a reference cycle (the function
    and its closure cell) that holds a view of its input until the collector runs."""

    def forward(self, x):
        h = x.shape[-1] // 2
        lo = x[..., :h]

        def pick(n):
            return lo if n == 0 else pick(n - 1)
        return torch.cat((-x[..., h:], pick(1)), dim=-1)


class _Halves(nn.Module):
    def forward(self, x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class _ViewHalves(nn.Module):
    """Returns a view of its input besides: the graph's own reference to the borrowed slot."""

    def forward(self, x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1), x[..., :h]


class _CalledTwice(nn.Module):
    """``a`` (q's first output) is still held when q replays again."""

    halves_cls = _CycleHalves

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.halves = self.halves_cls()

    def forward(self, x):
        a = self.q(x)
        if a.sum().item() > 1e9:  # a host sync: the root runs piecewise
            a = a * 0
        r = self.halves(a)
        if isinstance(r, tuple):
            r = r[0] + r[1].sum()
        b = self.q(x * 2)
        return r + a + b


class _CalledTwicePlain(_CalledTwice):
    halves_cls = _Halves


class _CalledTwiceView(_CalledTwice):
    halves_cls = _ViewHalves


# SLOT-2 (fixed since): _count_borrowed counts, as the new graph's own, a view of the borrowed
# slot that a garbage cycle of the capture's run still holds; once collected, q's slot baseline is
# one too high and q's second replay overwrites a
def test_a_cycle_made_by_a_borrowing_capture_is_not_the_graphs_own(sim):
    ref, g = _pair(_CalledTwice)
    bad = _calls(ref, g, 8, collect=True)
    q, halves = cg.stats(g.q), cg.stats(g.halves)
    assert q.replays >= 10 and halves.replays >= 5, (q, halves)
    assert halves.input_copies == 0, halves  # (it reads q's output where it lies)
    assert bad == [], f"calls {bad}: a overwritten by q's second replay"


def test_a_borrowing_capture_without_cycles_counts_right_with_the_collector_off(sim):
    """Control: the commit's case (views in run_layouts) under the same collector regime."""
    ref, g = _pair(_CalledTwicePlain)
    assert _calls(ref, g, 8, collect=True) == []
    q, halves = cg.stats(g.q), cg.stats(g.halves)
    assert q.replays >= 10 and halves.replays >= 5 and halves.input_copies == 0, (q, halves)


def test_a_view_of_the_borrowed_slot_the_graph_returns_is_its_own(sim):
    """Control: an output that is a view of the borrowed input (kept by the graph: counted as
    its own, for as long as the graph lives)."""
    ref, g = _pair(_CalledTwiceView)
    assert _calls(ref, g, 8, collect=True) == []
    q, halves = cg.stats(g.q), cg.stats(g.halves)
    assert q.replays >= 10 and halves.replays >= 5 and halves.input_copies == 0, (q, halves)


class _CycleLinear(nn.Module):
    """A linear layer whose forward keeps a view of its output in a garbage cycle."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        row = y[:1]

        def pick(n):
            return row if n == 0 else pick(n - 1)
        pick(1)
        return y


class _QTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = _CycleLinear()

    def forward(self, x):
        a = self.q(x)
        if a.sum().item() > 1e9:
            a = a * 0
        b = self.q(x * 2)
        return a + b


# SLOT-3 (fixed since): Slot.hand_out's lazy first baseline (the replay right after the capture)
# counts a view of the output that a garbage cycle of the capture's run still holds; once
# collected, the baseline is one too high and q's second replay overwrites a
def test_a_cycle_made_by_a_capture_is_not_in_its_outputs_baseline(sim):
    ref, g = _pair(_QTwice)
    bad = _calls(ref, g, 6, collect=True)
    assert cg.stats(g.q).replays >= 8, cg.stats(g.q)
    assert bad == [], f"calls {bad}: a overwritten by q's second replay"


# -- controls: the capture's other outcomes, and a released borrowing graph ------------------

_RUNS: dict = {}
_RUNS_AT = 3  # (the root's probed run, the piece's real call, its capture's run)


class _OtherPath(nn.Module):
    """Its capture's run takes another path (a Python counter, which no guard sees): the op
    sequences differ, and verify releases the graph it made reading q's output in place."""

    def forward(self, x):
        n = _RUNS[id(self)] = _RUNS.get(id(self), 0) + 1
        h = x.shape[-1] // 2
        lo = x[..., :h] * 1 if n == _RUNS_AT else x[..., :h]
        return torch.cat((-x[..., h:], lo), dim=-1)


class _CalledTwiceRefused(_CalledTwice):
    halves_cls = _OtherPath


def test_a_borrowing_capture_verify_refuses_leaves_no_count(sim):
    ref, g = _pair(_CalledTwiceRefused)
    _RUNS[id(ref.halves)] = -10 ** 6  # (the twin's runs take the one path)
    assert _calls(ref, g, 8, collect=True) == []
    q, why = cg.stats(g.q), list(cg.stats(g).eager_calls)
    assert q.replays >= 10 and cg.stats(g).captures == 1, q  # (q's: none of halves)
    assert any("op sequence differs" in r for r in why), why


class _FailsCapture(nn.Module):
    """Its capture's run raises (a Python counter, which no guard sees)."""

    def forward(self, x):
        n = _RUNS[id(self)] = _RUNS.get(id(self), 0) + 1
        if n == _RUNS_AT:
            raise RuntimeError("only the capture's run")
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class _CalledTwiceFails(_CalledTwice):
    halves_cls = _FailsCapture


def test_a_borrowing_capture_that_fails_leaves_no_count(sim):
    ref, g = _pair(_CalledTwiceFails)
    _RUNS[id(ref.halves)] = -10 ** 6
    assert _calls(ref, g, 8, collect=True) == []
    q, why = cg.stats(g.q), list(cg.stats(g).eager_calls)
    assert q.replays >= 10 and cg.stats(g).captures == 1, q
    assert any("capture failed" in r for r in why), why


class _Borrower(nn.Module):
    """q's output read in place by a piece with parameters (``h``), replaced between calls:
    its graph is released (``_disown``) and captured again."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.h = nn.Linear(8, 8)

    def forward(self, x):
        a = self.q(x)
        if a.sum().item() > 1e9:
            a = a * 0
        r = self.h(a)
        b = self.q(x * 2)
        return r + a + b


def test_a_released_borrowing_graph_gives_its_count_back(sim):
    ref, g = _pair(_Borrower)
    bad = []
    with torch.no_grad():
        for i in range(12):
            if i in (4, 8):  # a new weight: h's graph is released and captured again
                w = torch.randn(8, 8)
                ref.h.weight = nn.Parameter(w.clone())
                g.h.weight = nn.Parameter(w.clone())
            x = torch.randn(4, 8)
            with _collector_off():
                got = g(x)
            if not torch.equal(got, ref(x)):
                bad.append(i)
    assert bad == []
    q, h = cg.stats(g.q), cg.stats(g.h)
    assert q.replays >= 16 and h.replays >= 6 and h.captures >= 2, (q, h)
