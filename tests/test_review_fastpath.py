"""Review of 42f2886..ee88364 (the fast paths of pieces and regions), CPU, simulated backend:

1. f8a715c: a piece's timed graph turn (cudagraphify/_trial.py) replays through ``Fast.call``
   (``GraphedState._timed_replay``); a MISS forgets the sample and falls back to ``entry.run``.
2. 16935ed: ``EagerFast.call`` runs the forward without ``chained`` where segments are off and no
   piece may replay; ``DirectCall`` counts a given-back piece's call inline.
3. ee88364: ``Fast.call`` in a region skips ``protect_before`` where the graph's one output slot
   is the only live one and its last alias was dropped.

Every test compares against eager bitwise and checks that nothing a caller kept changed; the
count tests check that every call of a piece is counted exactly once
(calls == replays + timed_calls + seen_once + eager calls).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import threading

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _fast, _nested, _segrun, _wrap

# the fake device and host clocks, the piece and the fixture ``timed`` of tests/test_trial.py;
# the set-up of tests/test_opaque_plan.py; the outer module of tests/test_review_trial.py
from test_opaque_plan import _Cache, _Layer as _OpaqueLayer
from test_review_trial import _Outer
from test_trial import _COST, _Piece, _spend
from test_trial import _Root as _TrialRoot
from test_trial import timed as _trial_timed  # noqa: F401 (a fixture)


@pytest.fixture
def timed(_trial_timed, monkeypatch):  # noqa: F811 (test_trial's fixture, by another name)
    """test_trial's clocks: a piece's eager forward costs ``_COST["eager"]``, a replay of any
    graph ``_COST["graph"]`` (here 10 and 30 us unless a test sets them). Grad mode stays on as
    for any test (test_trial's fixture turns it off): these tests turn it off where they call.
    A piece given back keeps its proxy and DirectCall (``RETIRE_PIECES`` off): these tests
    count its calls through them, the path a share_graph layer's piece still takes."""
    monkeypatch.setattr(_wrap, "RETIRE_PIECES", False)
    _COST.update(eager=10e-6, graph=30e-6)
    with torch.enable_grad():
        yield _trial_timed


class _Root(_TrialRoot):
    """test_trial's root (a host sync between two pieces: piecewise, ``a`` and ``b`` graphed)
    returning both pieces' outputs (so the root hands out what lay on the implicit region's
    slots, copied)."""

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):  # a host sync
            y2 = y + 1
        else:
            y2 = y
        z = self.b(y2)
        return y, z


GIVE_BACK, KEEP = 30e-6, 1e-6


def _pair(cls=_Root, seed=0):
    torch.manual_seed(seed)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref))


def _eq(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    return type(got) is type(want) and len(got) == len(want) and \
        all(_eq(g, w) for g, w in zip(got, want))


def _calls_counted(piece) -> tuple[int, dict]:
    s = cg.stats(piece)
    return s.replays + s.timed_calls + s.seen_once + sum(s.eager_calls.values()), s


def _run(g, ref, calls: int) -> None:
    """``calls`` calls of ``g`` and of ``ref`` under no_grad, each on a new random input: every
    output eager's (none kept)."""
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(4, 8)
            assert _eq(g(x), ref(x))


def _run_held(g, ref, calls: int) -> list:
    """As ``_run``, each output kept: the (got, want) pairs, for the caller to hold."""
    held = []
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(4, 8)
            got, want = g(x), ref(x)
            assert _eq(got, want)
            held.append((got, want))
    return held


def _held_through_the_trial(cls, graph_cost: float, calls: int):
    """A root of ``cls`` graphed with a graph's replay costing ``graph_cost``: ``calls`` calls,
    every output eager's and, all held, unchanged after the last; the graphified root."""
    _COST.update(graph=graph_cost)
    ref, g = _pair(cls)
    held = _run_held(g, ref, calls)
    assert all(_eq(got, want) for got, want in held)
    return g


@contextlib.contextmanager
def _warming_elsewhere(on: bool = True):
    """Where ``on``: another thread is inside a warm-up or capture (``nesting[0]`` > 0) while
    the block runs."""
    inside, done = threading.Event(), threading.Event()

    def warming():
        with _nested.Nested():
            inside.set()
            done.wait(30)

    t = threading.Thread(target=warming)
    if on:
        t.start()
    try:
        if on:
            assert inside.wait(10)
        yield
    finally:
        done.set()
        if on:
            t.join(10)


# -- 1. the timed graph turn through Fast.call ------------------------------------------------

@pytest.mark.parametrize("graph_cost", [GIVE_BACK, KEEP], ids=["given_back", "kept"])
def test_trial_turns_results_held_outputs_and_counts(timed, graph_cost):
    """Held outputs (of every call, including the timed ones) keep their values; each piece call
    is counted once; a kept piece replays through the fast path afterwards."""
    _COST.update(graph=graph_cost)
    ref, g = _pair()
    held = _run_held(g, ref, 14)
    for got, want in held:
        assert _eq(got, want)
    for piece in (g.a, g.b):
        n, s = _calls_counted(piece)
        assert n == 13, s  # (the root's first call ran the submodules before they were pieces)
        assert s.timed_calls == 3, s
        state = piece._cudagraphify_state
        assert (state.given_back is not None) == (graph_cost == GIVE_BACK)
        if graph_cost == KEEP:
            assert type(state._fast) is _fast.Fast


@pytest.mark.parametrize("graph_cost", [GIVE_BACK, KEEP], ids=["given_back", "kept"])
def test_trial_turn_miss_while_another_thread_warms_up(timed, graph_cost):
    """Another thread inside a warm-up or capture (``nesting[0]`` > 0) makes every ``Fast.call``
    MISS: the trial's graph turn forgets its sample and falls back to ``entry.run``. Results,
    verdicts and counts are those of a run without that thread."""

    def run(with_thread: bool):
        _COST.update(graph=graph_cost)
        ref, g = _pair()
        with _warming_elsewhere(with_thread):
            _run(g, ref, 12)
        out = []
        for piece in (g.a, g.b):
            n, s = _calls_counted(piece)
            st = piece._cudagraphify_state
            out.append((n, s.timed_calls, s.replays, s.captures, s.graphs, dict(s.eager_calls),
                        st.given_back))
        return out

    assert run(True) == run(False)


class _ListPiece(nn.Module):
    """A piece called with a list: no Fast can be made for it (the full path flattens lists)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, xs):
        _spend("eager")
        return self.lin(xs[0]) + xs[1]


class _ListRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _ListPiece()
        self.b = _Piece(8, 8)

    def forward(self, x):
        y = self.a([x, x * 2])
        if bool((y > -1e9).all()):
            y = y + 1
        return self.b(y), y


@pytest.mark.parametrize("graph_cost", [GIVE_BACK, KEEP], ids=["given_back", "kept"])
def test_trial_of_a_piece_without_a_fast_path(timed, graph_cost):
    g = _held_through_the_trial(_ListRoot, graph_cost, 12)
    n, s = _calls_counted(g.a)
    assert n == 11 and s.timed_calls == 3, s
    assert g.a._cudagraphify_state._fast is None  # (never a Fast: a list argument)


@pytest.mark.parametrize("graph_cost", [GIVE_BACK, KEEP], ids=["given_back", "kept"])
def test_threads_through_the_trial(timed, graph_cost):
    """Four threads call the root at once while its pieces are captured and timed (the graph
    turn's Fast installed for one call while other threads may hold it): every output, held
    to the end, is eager's, and every piece call is counted once."""
    _COST.update(graph=graph_cost)
    ref, g = _pair()
    with torch.no_grad():
        x0 = torch.randn(4, 8)
        assert _eq(g(x0), ref(x0))  # (the root's plan, single-threaded)
    errors, results = [], []
    n_threads, n_calls = 4, 25
    start = threading.Barrier(n_threads)

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        mine = []
        try:
            start.wait(10)
            with torch.no_grad():
                for _ in range(n_calls):
                    x = torch.randn(4, 8, generator=gen)
                    mine.append((x, g(x)))
            results.extend(mine)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with torch.no_grad():
        bad = [k for k, (x, got) in enumerate(results) if not _eq(got, ref(x))]
    assert not bad, f"{len(bad)} of {len(results)} outputs differ from eager"
    for piece in (g.a, g.b):
        n, s = _calls_counted(piece)
        assert n == n_threads * n_calls, s
        assert s.timed_calls == 3, s


def test_trial_fast_is_not_left_installed_after_the_turn(timed):
    """The graph turn's Fast is this call's only: after each timed call the state has none, so a
    thread holding it misses (``state._fast is not self``)."""
    _COST.update(graph=KEEP)
    ref, g = _pair()
    seen = []
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(4, 8)
            assert _eq(g(x), ref(x))
            state = g.a.__dict__.get("_cudagraphify_state")
            entry = state and next(iter(state.all_graphs()), None)
            if entry is not None and entry.trial is not None:
                seen.append(state._fast)
    assert seen and all(f is None for f in seen), seen


# -- 2. EagerFast without chained; a given-back piece's call in DirectCall ---------------------

def test_given_back_piece_counted_once_per_call_on_every_path(timed):
    """A given-back piece's calls: through DirectCall (inline), through ``_call_impl`` (a hook on
    it: the full path) and inside another graph's warm-up and capture (not counted)."""
    ref, g = _pair()
    _run(g, ref, 10)
    state = g.a._cudagraphify_state
    why = state.given_back
    assert why is not None
    before = state.eager_calls[why]
    with torch.no_grad():
        for _ in range(3):  # DirectCall's inline count
            x = torch.randn(4, 8)
            assert torch.equal(g.a(x), ref.a(x))
        assert state.eager_calls[why] == before + 3
        h = g.a.register_forward_hook(lambda m, i, o: None)
        try:
            for _ in range(2):  # _call_impl -> the proxy -> GraphedState.__call__ -> slow
                x = torch.randn(4, 8)
                assert torch.equal(g.a(x), ref.a(x))
        finally:
            h.remove()
        assert state.eager_calls[why] == before + 5
        outer = cg.graphify(_Outer(g.a))
        x = torch.randn(4, 8)
        assert torch.equal(outer(x), ref.a(x) * 3)  # warm-up + capture: not a's calls
        assert state.eager_calls[why] == before + 5
        for _ in range(2):
            x = torch.randn(4, 8)
            assert torch.equal(outer(x), ref.a(x) * 3)  # replays: a does not run at all
        assert state.eager_calls[why] == before + 5


def test_given_back_piece_called_while_another_thread_warms_up(timed):
    """``_nesting[0]`` set by another thread: DirectCall hands the call to ``_given_back``, which
    counts it (it is not inside a warm-up on this thread)."""
    ref, g = _pair()
    with torch.no_grad():
        for _ in range(10):
            g(torch.randn(4, 8))
    state = g.a._cudagraphify_state
    why = state.given_back
    before = state.eager_calls[why]
    with _warming_elsewhere(), torch.no_grad():
        x = torch.randn(4, 8)
        assert torch.equal(g.a(x), ref.a(x))
    assert state.eager_calls[why] == before + 1


@pytest.mark.parametrize("toggle", ["ENABLED", "option"])
def test_segments_switched_on_at_runtime_after_pieces_are_given_back(timed, toggle,
                                                                     monkeypatch):
    """The root's decided (piecewise) calls take EagerFast's plain forward while segments are off
    and every piece is given back; switching segments on at runtime (``_segrun.ENABLED``, or
    the option) must reach ``chained`` (segments) again, and off again the plain forward."""
    ref, g = _pair()
    state = g._cudagraphify_state if "_cudagraphify_state" in g.__dict__ else None
    with torch.no_grad():
        _run(g, ref, 10)
        state = g._cudagraphify_state
        assert g.a._cudagraphify_state.given_back and g.b._cudagraphify_state.given_back
        assert type(state._fast) is _fast.EagerFast and not state._chain_needed()
        calls = []
        chained = type(state).chained
        monkeypatch.setattr(type(state), "chained",
                            lambda self, *a, **k: calls.append(1) or chained(self, *a, **k))
        x = torch.randn(4, 8)
        assert _eq(g(x), ref(x)) and not calls  # (the plain forward)
        if toggle == "ENABLED":
            monkeypatch.setattr(_segrun, "ENABLED", True)
        else:
            monkeypatch.setattr(state, "options",
                                dataclasses.replace(state.options, segments=True))
        _run(g, ref, 8)
        assert len(calls) >= 8, calls  # (segments call it again for the forward without them)
        assert state.segments.plans(), "segments were never recorded"
        if toggle == "ENABLED":
            monkeypatch.setattr(_segrun, "ENABLED", False)
        else:
            monkeypatch.setattr(state, "options",
                                dataclasses.replace(state.options, segments=False))
        calls.clear()
        _run(g, ref, 3)
        assert not calls


class _UserRoot(_Root):
    """A piecewise root with a submodule the user graphified (no piece: its graphs in the
    implicit region stay there when the pieces are given back)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        y, z = super().forward(x)
        return self.c(z), y


def test_user_graphed_submodule_keeps_the_chain_after_the_pieces_are_given_back(timed):
    torch.manual_seed(0)
    ref = _UserRoot()
    g = copy.deepcopy(ref)
    cg.graphify(g.c)
    cg.graphify(g)
    held = _run_held(g, ref, 14)
    assert g.a._cudagraphify_state.given_back and g.b._cudagraphify_state.given_back
    assert all(_eq(got, want) for got, want in held)
    state = g._cudagraphify_state
    assert state._chain_needed()  # (c has graphs in the implicit region)
    # the root's output is c's: a copy, not c's slot in the implicit region
    with torch.no_grad():
        x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
        o1 = g(x1)
        o2 = g(x2)
        assert _eq(o1, ref(x1)) and _eq(o2, ref(x2))


def test_regraphified_piece_after_give_back_rechains(timed):
    """A given-back piece ungraphified and graphified again by hand: its new state is live, the
    root chains again (EagerFast must not keep the plain forward), results are eager's."""
    ref, g = _pair()
    with torch.no_grad():
        for _ in range(10):
            g(torch.randn(4, 8))
    state = g._cudagraphify_state
    assert not state._chain_needed()
    _COST.update(graph=KEEP)
    cg.ungraphify(g.a)
    cg.graphify(g.a)
    held = _run_held(g, ref, 12)
    assert all(_eq(got, want) for got, want in held)
    assert state._chain_needed()
    s = cg.stats(g.a)
    # (its first call after the re-graphify runs outside the chain, a graph of its own cache:
    # the root looks again only once the new state is made; then one in the implicit region)
    assert s.graphs >= 1 and s.replays > 0, s


# -- 3. the region's slot check inline -----------------------------------------------------

def _lin(seed, n=8):
    torch.manual_seed(seed)
    ref = nn.Linear(n, n)
    return ref, cg.graphify(copy.deepcopy(ref))


def test_region_alias_kept_view_kept_data_kept_storage_kept(sim, quiet):
    """After the fast path is installed, each way of keeping the last output: the alias (moved),
    a view, ``.data``, its storage (the call runs eagerly): nothing kept changes."""
    ref, g = _lin(0)
    with torch.no_grad(), cg.graph_region() as r:
        for k in range(3):
            g(torch.randn(2, 8))
        state = g._cudagraphify_state
        assert type(state._fast) is _fast.Fast and state._fast.slot is not None
        keeps = []
        for how in ("alias", "view", "data", "storage", "alias", "none", "view"):
            x = torch.randn(2, 8)
            y = g(x)
            want = ref(x)
            assert torch.equal(y, want)
            if how == "alias":
                keeps.append((y, want))
            elif how == "view":
                keeps.append((y[1:], want[1:]))
            elif how == "data":
                keeps.append((y.data, want))
            elif how == "storage":
                keeps.append((y.untyped_storage(), want.clone()))
            del y
            x2 = torch.randn(2, 8)
            assert torch.equal(g(x2), ref(x2))
            for kept, w in keeps:
                if isinstance(kept, torch.UntypedStorage):
                    t = torch.empty(0).set_(kept, 0, (2, 8), (8, 1))
                    assert torch.equal(t, w)
                else:
                    assert torch.equal(kept, w)
        assert r.stats().moved_outputs >= 1  # (the first kept alias; then .data/storage block)


def test_region_alias_fed_back_and_two_graphs(sim, quiet):
    """Two graphed callables in one region, outputs fed into each other and back, some kept:
    every output eager's, every kept one unchanged."""
    ra, a = _lin(1)
    rb, b = _lin(2)
    keep = []
    with torch.no_grad(), cg.graph_region():
        for k in range(12):
            x = torch.randn(2, 8)
            ya = a(x)
            wa = ra(x)
            yb = b(ya)
            wb = rb(wa)
            yaa = a(yb)  # a's alias fed through b back into a
            waa = ra(wb)
            yaaa = a(yaa)  # a's own alias into a
            waaa = ra(waa)
            for got, want in ((ya, wa), (yb, wb), (yaa, waa), (yaaa, waaa)):
                assert torch.equal(got, want)
            if k % 3 == 0:
                keep.append((ya, wa))
            elif k % 3 == 1:
                keep.append((yb[0], wb[0]))
            for got, want in keep:
                assert torch.equal(got, want)


def test_region_closed_by_hand_inside_the_with(sim, quiet):
    ref, g = _lin(3)
    with torch.no_grad(), cg.graph_region() as r:
        for _ in range(3):
            g(torch.randn(2, 8))
        x = torch.randn(2, 8)
        kept, want = g(x), ref(x)
        r.close()
        with pytest.raises(cg.CudagraphifyError, match="closed"):
            g(torch.randn(2, 8))
        assert torch.equal(kept, want)


class _Three(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.k = k

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.k


class _TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y, y[:, :4] * 2


class _ViewOfInput(nn.Module):
    def forward(self, x):
        return x[:, :4]


def _fuzz_region(seed: int, steps: int = 120) -> dict:
    """Random calls of four graphed callables in one region (two batch sizes: two graphs a
    callable, several slots), outputs fed back at random, some kept (the alias, a view of it, an
    unsqueezed view), some dropped: every output is eager's, nothing kept changes."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    refs = [_Three(1.0), _Three(0.5), _TupleOut(), _ViewOfInput()]
    mods = [cg.graphify(copy.deepcopy(m)) for m in refs]
    kept: list = []  # (tensor the caller holds, its expected value)
    last: list = []  # outputs that may be fed back (tensor, expected)
    with torch.no_grad(), cg.graph_region() as region:
        for _ in range(steps):
            k = rng.randrange(len(mods))
            feed = [(t, w) for t, w in last if t.shape[-1] == 8]
            if feed and rng.random() < 0.5:
                src, want_in = rng.choice(feed)
            else:
                src = torch.randn(rng.choice((2, 3)), 8)
                want_in = src.clone()
            got = mods[k](src)
            want = refs[k](want_in)
            assert _eq(got, want), (seed, k)
            outs = list(got) if isinstance(got, tuple) else [got]
            wants = list(want) if isinstance(want, tuple) else [want]
            last = list(zip(outs, wants))
            r = rng.random()
            if r < 0.25:
                kept.append((outs[0], wants[0]))
            elif r < 0.4:
                kept.append((outs[0][:1], wants[0][:1]))
            elif r < 0.45:
                kept.append((outs[0].unsqueeze(0), wants[0].unsqueeze(0)))
            if kept and rng.random() < 0.3:
                kept.pop(rng.randrange(len(kept)))
            for t, w in kept:
                assert torch.equal(t, w), (seed, "a kept output changed")
            for t, w in last:
                assert torch.equal(t, w), (seed, "the last output changed")
        return {"replays": region.stats().replays, "moved": region.stats().moved_outputs}


@pytest.mark.parametrize("seed", range(16))
def test_region_fuzz(sim, quiet, seed):
    counts = _fuzz_region(seed)
    assert counts["replays"] > 5, counts  # (the region's graphs did replay)


def test_region_fast_path_skips_protect_before_only_where_nothing_is_held(sim, quiet,
                                                                         monkeypatch):
    """ee88364's inline case is taken (no protect_before) while the last alias is dropped, and
    protect_before runs (and moves the alias) while it is held."""
    from cudagraphify import _region
    calls = []
    protect = _region.GraphRegion.protect_before
    monkeypatch.setattr(_region.GraphRegion, "protect_before",
                        lambda self, e, leaves: calls.append(1) or protect(self, e, leaves))
    ref, g = _lin(4)
    with torch.no_grad(), cg.graph_region() as r:
        for _ in range(3):
            g(torch.randn(2, 8))
        assert type(g._cudagraphify_state._fast) is _fast.Fast
        calls.clear()
        for _ in range(4):
            x = torch.randn(2, 8)
            assert torch.equal(g(x), ref(x))
        assert not calls  # (inline: nothing held)
        x = torch.randn(2, 8)
        y, want = g(x), ref(x)
        x2 = torch.randn(2, 8)
        assert torch.equal(g(x2), ref(x2))
        assert calls and torch.equal(y, want) and r.stats().moved_outputs == 1


def test_trial_graph_turns_go_through_fast_call(timed, monkeypatch):
    """f8a715c's path is taken: each timed graph turn of a kept piece calls Fast.call."""
    _COST.update(graph=KEEP)
    turns = []
    call = _fast.Fast.call

    def spy(self, fn, args, kwargs):
        turns.append(self.entry.trial is not None)
        return call(self, fn, args, kwargs)

    monkeypatch.setattr(_fast.Fast, "call", spy)
    ref, g = _pair()
    _run(g, ref, 10)
    assert turns.count(True) == 2 * 3, turns


class _ChainRoot(nn.Module):
    """Pieces called in a tangle inside the implicit region: a piece's alias fed back into it,
    kept across a sync, a view of one kept, a piece called three times."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = _Piece(8, 8), _Piece(8, 8), _Piece(8, 8)

    def forward(self, x):
        y1 = self.a(x)
        v = y1[:, :2]
        y2 = self.a(y1)
        y3 = self.b(y2)
        if bool((y3 > -1e9).all()):
            y3 = y3 * 1.0
        y4 = self.a(y3)
        y5 = self.c(y4)
        y6 = self.b(y5)
        return y1, y2, y6, v.sum(1), self.c(y6)[0]


@pytest.mark.parametrize("graph_cost", [GIVE_BACK, KEEP], ids=["given_back", "kept"])
def test_chained_tangle_through_the_trial(timed, graph_cost):
    g = _held_through_the_trial(_ChainRoot, graph_cost, 16)
    for piece in (g.a, g.b, g.c):
        _, s = _calls_counted(piece)
        assert s.timed_calls == 3, s


# -- pieces planned around an opaque argument (an HF DynamicCache's shape), timed ------------

class _Layer(_OpaqueLayer):
    """test_opaque_plan's layer, returning its norm's output too."""

    def forward(self, x, cache):
        x = x + self.attn(self.norm(x), cache)
        return x + self.mlp(x), self.norm(x)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(2)])

    def forward(self, x, cache):
        normed = []
        for layer, c in zip(self.layers, cache.layers):
            x, n = layer(x, c)
            normed.append(n)
        return x, normed


@pytest.mark.parametrize("graph_cost", [30e-6, 0.0], ids=["given_back", "kept"])
def test_opaque_plan_decode_through_the_trials(timed, graph_cost):
    """Decode steps with a growing cache: the pieces around it (norms, MLPs, projections) are
    timed in the model's implicit region, through the fast path; the opaque roots' calls take
    EagerFast (plain once every piece is given back). Every output, kept to the end, is
    eager's; every piece call is counted once."""
    _COST.update(graph=graph_cost, eager=0.0)
    torch.manual_seed(0)
    ref = _Model()
    g = cg.graphify(copy.deepcopy(ref))
    held = []
    with torch.no_grad():
        for _ in range(3):  # three sequences of 7 steps
            rc, c = _Cache(), _Cache()
            for _ in range(7):
                x = torch.randn(1, 1, 8)
                got, want = g(x, c), ref(x, rc)
                assert _eq(got, want)
                held.append((got, want))
    assert all(_eq(got, want) for got, want in held)
    pieces = [m for layer in g.layers for m in (layer.norm, layer.mlp, layer.attn.q,
                                                layer.attn.k)]
    for piece in pieces:
        s = cg.stats(piece)
        assert s.timed_calls == 3, (piece, s)
        assert (piece._cudagraphify_state.given_back is not None) == (graph_cost > 0), s
    # (the root keeps its implicit region even with every piece given back: its layers, which
    # get the cache, are pieces that plan their own and are never given back)
    assert g._cudagraphify_state._chain_needed()


class _KwPiece(nn.Linear):
    def forward(self, x=None, mask=None, scale=1.0, y=None):
        _spend("eager")
        out = super().forward(x) * scale + y
        return out if mask is None else out + mask


class _KwRoot(nn.Module):
    """Pieces called by keyword (a None, a float and two tensors), one of them also called by
    the user directly between the root's calls (a graph of its own cache, its own trial)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _KwPiece(8, 8), _KwPiece(8, 8)

    def forward(self, x):
        y = self.a(x=x, mask=None, scale=0.5, y=x)
        if bool((y > -1e9).all()):
            y = y + 1
        return self.b(y=x, x=y, mask=None, scale=2.0), y


@pytest.mark.parametrize("graph_cost", [GIVE_BACK, KEEP], ids=["given_back", "kept"])
def test_keyword_pieces_and_direct_calls_between_root_calls(timed, graph_cost):
    _COST.update(graph=graph_cost)
    ref, g = _pair(_KwRoot)
    held = []
    with torch.no_grad():
        for k in range(16):
            x = torch.randn(4, 8)
            got, want = g(x), ref(x)
            assert _eq(got, want)
            held.append((got, want))
            if k % 2:
                x2 = torch.randn(4, 8)
                d, w = g.a(x=x2, mask=None, scale=0.5, y=x2), ref.a(x=x2, mask=None, scale=0.5,
                                                                   y=x2)
                assert torch.equal(d, w)
                held.append((d, w))
    assert all(_eq(got, want) for got, want in held)
    n, s = _calls_counted(g.b)
    assert n == 15 and s.timed_calls == 3, s
    n, s = _calls_counted(g.a)
    # (the first direct call, outside the implicit region, is its own cache's warm-up and
    # capture: its result is the warm-up's, neither a replay nor an eager call)
    assert n == 15 + 8 - 1 and s.captures == 2, s
