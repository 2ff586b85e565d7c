"""Review of edbdfad (``PieceRuns._chained`` runs plain inside a capture of the caller's own):
every path by which a graphified callable is called while the current stream is captured by
the user (``with torch.cuda.graph(g): y = model(x)``), or by another thread meanwhile.

CPU double (tests/conftest.py). "The user's capture" is either ``_user_capture`` (the caller's
stream is captured: ``backend.in_capture()`` holds on this thread) or ``sim.capture`` used as
the user's own ``torch.cuda.graph`` (it records the ops, flags host syncs as unreplayable, and
its replay shows whether what was captured gives eager's bits for new inputs). Streams: one
per thread (``_Streams``: a token is the thread's name; ``order_after`` is recorded), with
``_UserStreams.user`` the threads inside a capture of their own, and ``drain`` recorded.

Findings are ``xfail(strict=True)``: they fail on the code reviewed. Controls pass."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture, _engine, _pieces
from test_region_alias import _Drops, _PAUSES, _Streams
from test_review_plan import _Ctx, _OpaqueRoot, _user_capture

_CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _UserStreams(_Streams):
    """``_Streams`` where the threads named in ``user`` are inside a capture of their own
    (switched on and off by the test, unlike test_region_alias's ``_UserCapture``, where
    thread "A" is always capturing), and ``drain`` (a host wait on a stream:
    ``cudaStreamSynchronize``, which a stream under capture refuses) is recorded."""

    def __init__(self):
        super().__init__()
        self.user: set[str] = set()
        self.drains: list[tuple[str, object]] = []

    def in_capture(self):
        return self.capturing or threading.current_thread().name in self.user

    def drain(self, device, token):
        self.drains.append((threading.current_thread().name, token))

    def stream_capturing(self, device, token):
        return token in self.user  # (a thread's stream: its name)


@pytest.fixture
def streams():
    backend = _UserStreams()
    old = _capture.set_backend(backend)
    try:
        yield backend
    finally:
        _capture.set_backend(old)
        _PAUSES.clear()


def _two_threads(a, b, timeout=30):
    ts = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a thread hung"


def _a_captures_on_the_stream_that_replayed_last(backend, g, ref, between):
    """Thread A calls ``g`` on its stream (its graphs replay there: the stream that replayed
    last is A's), then enters a capture of its own on that same stream (``torch.cuda.graph(g,
    stream=s)`` after a warm-up on ``s``, as the PyTorch recipe's warm-up stream) and calls
    ``g`` inside it; meanwhile thread B runs ``between()``. Returns what each got and what B
    ordered or drained while A's capture was under way."""
    inside, done = threading.Event(), threading.Event()
    xa = torch.randn(4, 8)
    out: dict = {}

    def a():
        with torch.no_grad():
            for _ in range(4):  # (captured, then replayed on A's stream)
                x = torch.randn(4, 8)
                assert torch.equal(g(x), ref(x))
            backend.user.add("A")
            try:
                out["a"] = g(xa)  # (inside A's capture: plain, part of it)
                inside.set()
                assert done.wait(30)
            finally:
                backend.user.discard("A")

    def b():
        assert inside.wait(30)
        del backend.orders[:], backend.drains[:]
        try:
            with torch.no_grad():
                out["b"] = between()
        finally:
            out["orders"], out["drains"] = list(backend.orders), list(backend.drains)
            done.set()

    _two_threads(a, b)
    with torch.no_grad():
        assert torch.equal(out["a"], ref(xa))
    return out


# -- finding 1: another thread's replay orders after (or drains) the stream under capture ----

# (fixed: the replay runs eagerly while the stream that replayed last is under another
# thread's capture, _engine.CAPTURED_ELSEWHERE; it was ordered after it, which on a GPU
# joins that capture: B's replay captured, not run)
def test_b_replay_does_not_wait_on_a_stream_under_capture_whole_graph(streams):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    xb = torch.randn(4, 8)
    out = _a_captures_on_the_stream_that_replayed_last(streams, g, ref, lambda: g(xb))
    with torch.no_grad():
        assert torch.equal(out["b"], ref(xb))
    assert ("B", "A") not in out["orders"], out["orders"]
    assert cg.stats(g).eager_calls[_engine.CAPTURED_ELSEWHERE] == 1
    with torch.no_grad():  # (the capture over: B's stream orders after A's, and replays)
        replays = cg.stats(g).replays
        assert torch.equal(g(xb), ref(xb))
    assert cg.stats(g).replays == replays + 1


def test_b_replay_does_not_wait_on_a_stream_under_capture_pieces(streams):
    torch.manual_seed(0)
    ref = _OpaqueRoot()
    g = cg.graphify(copy.deepcopy(ref))
    ctx = _Ctx()
    xb = torch.randn(4, 8)

    class _Bound(nn.Module):  # (the helper calls g(x): ctx bound)
        def forward(self, x):
            return g(x, ctx)

    class _Ref(nn.Module):
        def forward(self, x):
            return ref(x, ctx)

    out = _a_captures_on_the_stream_that_replayed_last(streams, _Bound(), _Ref(),
                                                       lambda: g(xb, ctx))
    with torch.no_grad():
        assert torch.equal(out["b"], ref(xb, ctx))
    assert cg.stats(g.a).replays >= 1
    assert ("B", "A") not in out["orders"], out["orders"]
    assert cg.stats(g.a).eager_calls[_engine.CAPTURED_ELSEWHERE] >= 1


@pytest.mark.xfail(strict=True, reason=(
    "FINDING: a release on B (parameters moved: invalidate -> release) drains the stream "
    "that replayed last, A's, while A captures on it (CudaBackend.drain checks only the "
    "caller's own stream: cudaStreamSynchronize on a capturing stream fails and invalidates "
    "the user's capture)"))
def test_b_release_does_not_drain_a_stream_under_capture(streams):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    xb = torch.randn(4, 8)

    def moved_then_call():
        g.weight.data = g.weight.data.clone()  # (new memory: B's call releases the graphs)
        return g(xb)

    out = _a_captures_on_the_stream_that_replayed_last(streams, g, ref, moved_then_call)
    with torch.no_grad():
        assert torch.equal(out["b"], ref(xb))
    assert ("B", "A") not in out["drains"], out["drains"]


def _settled_opaque():
    torch.manual_seed(0)
    ref = _OpaqueRoot()
    g = cg.graphify(copy.deepcopy(ref))
    ctx = _Ctx()
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(g(x, ctx), ref(x, ctx))
    assert cg.stats(g.a).replays >= 1, "the pieces replay before the user's capture"
    return ref, g, ctx


def test_control_b_does_not_wait_on_a_when_a_captures_on_another_stream(streams):
    # the commit's case: A's capture is on a stream that did not replay last (torch.cuda.graph
    # without stream=: its own capture stream): nothing of B's orders after A
    ref, g, ctx = _settled_opaque()
    inside, done = threading.Event(), threading.Event()
    xa, xb, out = torch.randn(4, 8), torch.randn(4, 8), {}

    def a():
        streams.user.add("A")
        try:
            with torch.no_grad():
                out["a"] = g(xa, ctx)
            inside.set()
            assert done.wait(30)
        finally:
            streams.user.discard("A")

    def b():
        assert inside.wait(30)
        del streams.orders[:]
        with torch.no_grad():
            out["b"] = g(xb, ctx)
        out["orders"] = list(streams.orders)
        done.set()

    _two_threads(a, b)
    with torch.no_grad():
        assert torch.equal(out["a"], ref(xa, ctx)) and torch.equal(out["b"], ref(xb, ctx))
    assert not [o for o in out["orders"] if "A" in o], out["orders"]
    assert "A" not in g._cudagraphify_state._chain.streams.values()


# -- finding 2: the eager fast path counts (and notes) a call inside the user's capture -------

@pytest.mark.xfail(strict=True, reason=(
    "FINDING (stats): EagerFast.call counts eager_calls[reason] (and notes capture_sizes) "
    "before chained's in-capture return; the slow path counts nothing inside a capture "
    "(GraphedState.slow: in_capture -> plain, uncounted but for a plan trial's Plain). The "
    "same call is counted or not depending on whether the previous call left a fast path"))
def test_a_call_inside_the_users_capture_is_not_counted_by_the_eager_fast_path(sim):
    ref, g, ctx = _settled_opaque()
    with torch.no_grad():
        state = g._cudagraphify_state
        assert state._fast is not None  # (EagerFast.opaque)
        before = sum(cg.stats(g).eager_calls.values())
        x = torch.randn(4, 8)
        assert torch.equal(_user_capture(sim, lambda: g(x, ctx)), ref(x, ctx))
        assert sum(cg.stats(g).eager_calls.values()) == before


def test_control_the_slow_path_does_not_count_a_call_inside_the_users_capture(sim):
    torch.manual_seed(0)
    ref = _OpaqueRoot()
    g = cg.graphify(copy.deepcopy(ref))
    ctx = _Ctx()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            assert torch.equal(g(x, ctx), ref(x, ctx))
        g._cudagraphify_state._fast = None  # (no fast path: the slow path decides)
        before = sum(cg.stats(g).eager_calls.values())
        x = torch.randn(4, 8)
        assert torch.equal(_user_capture(sim, lambda: g(x, ctx)), ref(x, ctx))
        assert sum(cg.stats(g).eager_calls.values()) == before


# -- finding 3 (fixed): bucketed's first call of a size synchronised inside the user's capture

# (fixed: inside a capture of the caller's own, a size not yet checked runs unpadded, as part
# of it; before, its check ran there: host syncs, which a capture refuses)
def test_bucketed_check_does_not_sync_inside_the_users_capture(sim):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    bm = cg.bucketed(cg.graphify(copy.deepcopy(ref)), sizes=[8])
    with torch.no_grad():
        x = torch.randn(5, 8)
        graph, out = sim.capture(lambda: bm(x), _CPU)  # (the user's torch.cuda.graph)
        assert not graph.unreplayable, graph.unreplayable
        x.copy_(torch.randn(5, 8))
        graph.replay()
        assert torch.equal(out, ref(x))


def test_control_bucketed_after_its_check_is_captured_by_the_user(sim):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    bm = cg.bucketed(cg.graphify(copy.deepcopy(ref)), sizes=[8])
    with torch.no_grad():
        x = torch.randn(5, 8)
        torch.testing.assert_close(bm(x), ref(x))  # (the check, outside any capture)
        graph, out = sim.capture(lambda: bm(x), _CPU)
        assert not graph.unreplayable, graph.unreplayable
        x.copy_(torch.randn(5, 8))
        graph.replay()
        torch.testing.assert_close(out, ref(x), rtol=0, atol=1e-6)


# -- controls: the change itself ----------------------------------------------------------

def test_control_a_root_with_pieces_in_the_users_capture_is_captured_plain(sim):
    # the user's capture (sim.capture) holds the root's plain ops, pieces included: none of
    # our graphs replays inside it, no alias of a region's slot is handed out, and its replay
    # gives eager's bits for new inputs; afterwards the pieces replay again
    ref, g, ctx = _settled_opaque()
    state = g._cudagraphify_state
    with torch.no_grad():
        static_x = torch.randn(4, 8)
        replays = sim.replays
        graph, static_y = sim.capture(lambda: g(static_x, ctx), _CPU)
        assert sim.replays == replays, "one of our graphs replayed inside the user's capture"
        assert not graph.unreplayable
        slots = {s.storage.data_ptr() for s in state._chain._slots.values()}
        assert static_y.untyped_storage().data_ptr() not in slots
        assert not state._chain.streams and not state._chain._live
        for _ in range(3):
            static_x.copy_(torch.randn(4, 8))
            graph.replay()
            assert torch.equal(static_y, ref(static_x, ctx))
        before = cg.stats(g.a).replays
        for _ in range(2):
            x = torch.randn(4, 8)
            assert torch.equal(g(x, ctx), ref(x, ctx))
        assert cg.stats(g.a).replays > before


def test_control_keyed_root_and_chained_once_are_left_as_they_were(sim):
    ref, g, ctx = _settled_opaque()
    with torch.no_grad():
        x = torch.randn(4, 8)
        assert torch.equal(_user_capture(sim, lambda: g(x, ctx)), ref(x, ctx))
    assert _pieces.keyed_root.get() is False
    captures = sim.captures
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 8)
            assert torch.equal(g(x, ctx), ref(x, ctx))
    assert sim.captures == captures, "a call inside the user's capture cost a recapture"


def test_control_a_decided_piecewise_root_in_the_users_capture(sim):
    # a piecewise entry decided for a signature (a host sync in the root): EagerFast.decided
    # -> chained -> plain inside the capture (on the double: a host sync captures fine)
    torch.manual_seed(0)
    ref = _Drops()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
        assert type(g._cudagraphify_state._fast).__name__ == "EagerFast"
        replays = sim.replays
        x = torch.randn(4, 8)
        assert torch.equal(_user_capture(sim, lambda: g(x)), ref(x))
        assert sim.replays == replays
        chain = g._cudagraphify_state._chain
        assert not chain.streams and not chain._live


def test_control_segments_do_not_record_or_replay_inside_the_users_capture(sim,
                                                                           segments_enabled):
    torch.manual_seed(0)
    ref = _Drops()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
        segs = g._cudagraphify_state.segments
        counts, replays, captures = segs.counts(), sim.replays, sim.captures
        x = torch.randn(4, 8)
        assert torch.equal(_user_capture(sim, lambda: g(x)), ref(x))
        assert (segs.counts(), sim.replays, sim.captures) == (counts, replays, captures)


def test_control_a_whole_graph_fast_path_misses_inside_the_users_capture(streams):
    # Fast.call's capture check (a stream token that is not 0): no replay inside the capture
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    out = {}

    def a():
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(4, 8)
                assert torch.equal(g(x), ref(x))
            assert g._cudagraphify_state._fast is not None
            replays = streams.replays
            streams.user.add("A")
            try:
                x = torch.randn(4, 8)
                out["ok"] = torch.equal(g(x), ref(x)) and streams.replays == replays
            finally:
                streams.user.discard("A")

    t = threading.Thread(target=a, name="A")
    t.start()
    t.join(30)
    assert out.get("ok")
