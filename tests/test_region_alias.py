"""A region's output aliases (CPU, simulated backend): what a caller does to one, then the
next replay.

A region hands out an inference graph's outputs as aliases of its static outputs; before a
replay overwrites that memory, an alias the caller still holds is moved to a copy, and a view
of one (or another tensor on that memory) makes the call run eagerly. These tests change or
keep an alias in the ways a caller can and check that every output is eager's and that
nothing the caller kept changed.
"""

from __future__ import annotations

import copy
import threading
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture, _engine
from conftest import SimBackend


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    ref = nn.Linear(8, 8)
    return ref, cg.graphify(copy.deepcopy(ref))


def _regions_slot(region):
    (slot,) = region._slots.values()
    return slot


def test_a_kept_output_is_moved_and_a_new_alias_handed_out(sim):
    ref, g = _pair()
    with torch.no_grad(), cg.graph_region() as r:
        g(torch.randn(2, 8))
        x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
        y1 = g(x1)
        y2 = g(x2)
        assert y1 is not y2
        assert torch.equal(y1, ref(x1)) and torch.equal(y2, ref(x2))
        assert r.stats().moved_outputs == 1


def _set_grad(y):
    y.grad = torch.ones_like(y)


def _hook(y):
    y.requires_grad_(True)
    y.register_hook(lambda grad: grad)
    y.requires_grad_(False)


@pytest.mark.parametrize("change", [
    lambda y: y.t_(),
    lambda y: y.unsqueeze_(0),
    lambda y: y.resize_(16),
    lambda y: y.as_strided_((2, 4), (8, 1), 1),
    lambda y: y.set_(torch.zeros(2, 8)),
    lambda y: y.requires_grad_(True),
    _set_grad,
    _hook,
    lambda y: setattr(y, "note", "mine"),
], ids=["t_", "unsqueeze_", "resize_", "as_strided_", "set_", "requires_grad_", "grad", "hook",
        "attribute"])
def test_an_alias_the_caller_changed_and_dropped_leaves_later_outputs_fresh(sim, change):
    ref, g = _pair()
    with torch.no_grad(), cg.graph_region():
        g(torch.randn(2, 8))
        y = g(torch.randn(2, 8))
        change(y)
        del y
        x = torch.randn(2, 8)
        out = g(x)
        assert torch.equal(out, ref(x))
        assert out.shape == (2, 8) and out.stride() == (8, 1) and not out.requires_grad
        assert out.grad is None and out._backward_hooks is None and not out.__dict__
        assert type(out) is torch.Tensor
        del out
        x = torch.randn(2, 8)
        assert torch.equal(g(x), ref(x))


@pytest.mark.parametrize("keep", [False, True])
def test_an_alias_the_caller_grew_takes_the_graphs_memory_and_the_graph_runs_eagerly(sim, keep):
    # (growing it reallocates the storage the graph writes: a later replay would write the old
    # memory, which the pool may hand to a later capture; the graph runs eagerly from then on)
    ref, g = _pair()
    with torch.no_grad(), cg.graph_region():
        g(torch.randn(2, 8))
        y = g(torch.randn(2, 8))
        y.resize_(64, 8)
        y.fill_(7.0)
        if not keep:
            del y
        for _ in range(3):
            x = torch.randn(2, 8)
            assert torch.equal(g(x), ref(x))
        if keep:
            assert torch.equal(y, torch.full((64, 8), 7.0))
    reasons = cg.stats(g).eager_calls
    assert sum(n for r, n in reasons.items() if "resized in place" in r) == 3, reasons


def test_a_weak_reference_to_an_alias_stops_its_reuse(sim):
    ref, g = _pair()
    with torch.no_grad(), cg.graph_region():
        g(torch.randn(2, 8))
        y = g(torch.randn(2, 8))
        finalized = []
        weakref.finalize(y, finalized.append, True)
        del y
        x = torch.randn(2, 8)
        out = g(x)
        assert torch.equal(out, ref(x))
        assert finalized == [True]  # nothing kept it alive: a finalizer waiting for it ran


def test_an_alias_saved_for_backward_keeps_its_values(sim):
    ref, g = _pair()
    w = torch.randn(2, 8, requires_grad=True)
    with cg.graph_region():
        with torch.no_grad():
            g(torch.randn(2, 8))
            x1 = torch.randn(2, 8)
            y = g(x1)
        loss = (w * y).sum()  # autograd saves y (its TensorImpl), Python drops it below
        del y
        with torch.no_grad():
            x2 = torch.randn(2, 8)
            assert torch.equal(g(x2), ref(x2))
        try:
            loss.backward()
        except RuntimeError as e:  # eager's own check of a saved tensor written in place
            assert "modified by an inplace operation" in str(e)
        else:
            assert torch.equal(w.grad, ref(x1).detach())


def test_a_view_of_a_dropped_alias_still_forces_eager(sim):
    ref, g = _pair()
    with torch.no_grad(), cg.graph_region():
        g(torch.randn(2, 8))
        x1 = torch.randn(2, 8)
        row = g(x1)[0]  # the alias is dropped at once, its view kept
        want = ref(x1)[0]
        x2 = torch.randn(2, 8)
        assert torch.equal(g(x2), ref(x2))
        assert torch.equal(row, want)
    assert any("through a view" in reason for reason in cg.stats(g).eager_calls)


def test_an_alias_swapped_into_another_tensor_is_not_overwritten(sim):
    ref, g = _pair()
    with torch.no_grad(), cg.graph_region():
        g(torch.randn(2, 8))
        x1 = torch.randn(2, 8)
        y = g(x1)
        other = torch.zeros(2, 8)
        try:
            torch.utils.swap_tensors(y, other)  # ``other`` now holds the slot's memory
        except RuntimeError as e:  # the region keeps a weak reference to the alias
            assert "weakref" in str(e)
            return
        del y
        want = ref(x1)
        x2 = torch.randn(2, 8)
        assert torch.equal(g(x2), ref(x2))
        assert torch.equal(other, want)


def test_a_chain_matches_eager_and_a_kept_output_survives(sim):
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    g = copy.deepcopy(ref)
    for blk in g:
        cg.graphify(blk)
    with torch.no_grad(), cg.graph_region() as r:
        g(torch.randn(2, 8))
        for _ in range(4):
            x = torch.randn(2, 8)
            assert torch.equal(g(x), ref(x))
        assert r.stats().moved_outputs == 0
        kept = g(x)
        g(torch.randn(2, 8))
        assert torch.equal(kept, ref(x))
        assert r.stats().moved_outputs == 1


@pytest.mark.parametrize("seed", range(6))
def test_random_calls_of_three_graphs_keep_every_held_output(sim, seed):
    """Three graphs in one region called in a random order, each output kept or dropped at
    random: every kept output keeps eager's values to the end, and the region's bound on the
    capture order of its live slots (``_live_top``, which lets a chain's next replay skip the
    walk over earlier pieces' outputs) never falls below a live slot's."""
    gen = torch.Generator().manual_seed(seed)
    pairs = [_pair(seed * 3 + k) for k in range(3)]
    kept = []
    with torch.no_grad(), cg.graph_region() as r:
        for k in range(60):
            i = int(torch.randint(0, 3, (1,), generator=gen))
            ref, g = pairs[i]
            x = torch.randn(2, 8, generator=gen)
            y = g(x)
            want = ref(x)
            assert torch.equal(y, want)
            if torch.rand(1, generator=gen).item() < 0.3:
                kept.append((y, want))
            assert all(s.seq <= r._live_top for s in r._live), (k, r._live_top)
        for y, want in kept:
            assert torch.equal(y, want)
        assert sum(cg.stats(g).replays for _, g in pairs) > 0


_HELD, _RESUME = threading.Event(), threading.Event()


class _Waits(nn.Module):
    """Two pieces around a host sync; on thread "A" the forward holds a's output (an alias in
    the callable's own region) while it waits for another thread's whole call."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if bool((y > 1e9).any()):  # (a host sync: the root runs piecewise, its pieces chained)
            raise AssertionError
        if threading.current_thread().name == "A":
            _HELD.set()
            _RESUME.wait(30)
        return self.b(y + 1)


def test_a_piece_does_not_move_or_overwrite_an_alias_another_thread_holds(sim):
    # Thread A's forward holds piece a's output, an alias of its static memory; thread B calls
    # the same root meanwhile. Moving A's alias to a copy (set_) while an op of A's reads it
    # with the GIL released (on a GPU: queued on A's stream) gave that op the replay's values:
    # B's call of a runs eagerly instead, and nothing of A's is moved
    torch.manual_seed(0)
    ref = _Waits()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(4):  # (the plan, then both pieces captured and replaying)
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
        assert cg.stats(g.a).replays >= 1
        inner = g._cudagraphify_state._chain
        moved = inner.moved_outputs
        xa, xb, out = torch.randn(4, 8), torch.randn(4, 8), {}

        def run(name, x):
            with torch.no_grad():
                out[name] = g(x)

        ta = threading.Thread(target=run, args=("A", xa), name="A")
        ta.start()
        assert _HELD.wait(30)
        tb = threading.Thread(target=run, args=("B", xb), name="B")
        tb.start()
        tb.join(30)
        _RESUME.set()
        ta.join(30)
        assert torch.equal(out["A"], ref(xa)) and torch.equal(out["B"], ref(xb))
    assert inner.moved_outputs == moved
    assert cg.stats(g.a).eager_calls[_engine.HELD_BY_ANOTHER_THREAD] == 1


class _Streams(SimBackend):
    """The CPU double with a stream per thread (its token: the thread's name) that records
    where a replay is ordered after another stream."""

    def __init__(self):
        super().__init__()
        self.orders: list[tuple[str, str]] = []

    def stream_token(self, device):
        return threading.current_thread().name

    def order_after(self, device, token):
        self.orders.append((threading.current_thread().name, token))


class _Drops(nn.Module):
    """Two pieces around a host sync; on thread "A" the forward waits twice: holding a's output,
    then after an op that read it and dropped it (on a GPU that op may still be queued on A's
    stream)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if bool((y > 1e9).any()):
            raise AssertionError
        _pause("held")
        y = y * 2 + 1  # (a's output dropped)
        _pause("dropped")
        return self.b(y)


_PAUSES: dict = {}


def _pause(stage):
    p = _PAUSES.get((threading.current_thread().name, stage))
    if p is not None:
        p[0].set()
        assert p[1].wait(30), stage


def test_threads_on_streams_of_their_own_order_each_replay_after_the_others(monkeypatch):
    # Thread A drops a's output with an op that reads it still queued on its stream (a GPU's);
    # thread B, which replayed last on its own stream, then replays a: it must be ordered after
    # A's stream first (before, a region ordered a replay only after the stream that replayed
    # last: B's own, and B's replay overwrote a's output under A's queued op)
    backend = _Streams()
    old = _capture.set_backend(backend)
    try:
        torch.manual_seed(0)
        ref = _Drops()
        g = cg.graphify(copy.deepcopy(ref))
        with torch.no_grad():
            for _ in range(4):  # (on the main thread: the plan, then a and b replaying)
                x = torch.randn(4, 8)
                assert torch.equal(g(x), ref(x))
        assert cg.stats(g.a).replays >= 1
        e = [threading.Event() for _ in range(4)]
        _PAUSES.update({("A", "held"): (e[0], e[1]), ("A", "dropped"): (e[2], e[3])})
        xa, xb1, xb2, out = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8), {}

        def a():
            with torch.no_grad():
                out["a"] = g(xa)

        def b():
            with torch.no_grad():
                assert e[0].wait(30)
                out["b1"] = g(xb1)  # (a held by A: eager; b replays on B's stream)
                e[1].set()
                assert e[2].wait(30)
                del backend.orders[:]
                out["b2"] = g(xb2)  # a replays on B's stream, A's run still under way
                out["orders"] = list(backend.orders)
                e[3].set()

        ts = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        _PAUSES.clear()
        with torch.no_grad():
            for k, x in (("a", xa), ("b1", xb1), ("b2", xb2)):
                assert torch.equal(out[k], ref(x)), k
        assert ("B", "A") in out["orders"], out["orders"]
        assert cg.stats(g.a).eager_calls[_engine.HELD_BY_ANOTHER_THREAD] == 1
        # one thread again: after one replay ordered after the others, no more orders
        del backend.orders[:]
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(4, 8)
                assert torch.equal(g(x), ref(x))
        # (A replayed last, after ordering its b after B's stream: one order, then none)
        assert backend.orders == [("MainThread", "A")], backend.orders
        assert g._cudagraphify_state._chain._stream_token == "MainThread"
    finally:
        _capture.set_backend(old)
        _PAUSES.clear()


class _UserCapture(_Streams):
    """``_Streams`` where thread "A" is inside a capture of the user's own (a
    ``torch.cuda.graph`` around its call): its stream may not wait for work outside the
    capture, and no other stream may wait for it (on a GPU that stream would join the capture:
    its replay captured, not run)."""

    def in_capture(self):
        return self.capturing or threading.current_thread().name == "A"


def test_a_run_inside_a_users_capture_is_no_stream_of_the_region(monkeypatch):
    # A root with pieces, called by thread A inside a capture of A's own: its pieces run plain,
    # as part of that capture. Before, the root's run still went through its implicit region
    # (the EagerFast path of a piecewise root does not ask whether a capture is under way):
    # A's capturing stream was listed in the region's streams, so B's replay waited on it, and
    # at the end of A's run A's stream waited on the stream that had replayed last.
    backend = _UserCapture()
    old = _capture.set_backend(backend)
    try:
        torch.manual_seed(0)
        ref = _Drops()
        g = cg.graphify(copy.deepcopy(ref))
        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(4, 8)
                assert torch.equal(g(x), ref(x))
        assert cg.stats(g.a).replays >= 1
        e = [threading.Event() for _ in range(2)]
        _PAUSES[("A", "held")] = (e[0], e[1])
        xa, xb, out = torch.randn(4, 8), torch.randn(4, 8), {}
        replays = cg.stats(g.a).replays
        del backend.orders[:]

        def a():
            with torch.no_grad():
                out["a"] = g(xa)

        def b():
            with torch.no_grad():
                assert e[0].wait(30)  # (A inside its run, inside its capture)
                out["b"] = g(xb)
                e[1].set()

        ts = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        _PAUSES.clear()
        with torch.no_grad():
            for k, x in (("a", xa), ("b", xb)):
                assert torch.equal(out[k], ref(x)), k
        assert not [o for o in backend.orders if "A" in o], backend.orders
        assert cg.stats(g.a).replays > replays  # (B's a replayed: the graph path)
        assert "A" not in g._cudagraphify_state._chain.streams.values()
    finally:
        _capture.set_backend(old)
        _PAUSES.clear()
