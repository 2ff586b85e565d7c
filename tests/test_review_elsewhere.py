"""Review of 7ec8df7 + dadf0ac (CAPTURED_ELSEWHERE: a call whose graphs last replayed on a
stream now under another thread's capture of its own runs eagerly; ``GraphRegion.exit_run``
keeps such a stream pending; ``CudaBackend.stream_capturing``).

CPU double: ``_UserStreams`` (tests/test_review_usercapture.py; a stream per thread, its token
the thread's name, ``user`` the threads inside a capture of their own). ``_DeviceSyncs`` also
records what, on a GPU, is a host wait on the whole device (``torch.cuda.synchronize()``:
``CudaBackend.capture`` begins with one, ``drain_all`` is one) while another thread's capture is
under way. The CUDA programming guide: "it is also invalid to query the execution status of or
synchronize a broader handle which encompasses an active stream capture, such as a device or
context handle when any associated stream is in capture mode" (the sync fails and invalidates
the user's capture). GPU counterpart: .ci/review/usercapture/d_elsewhere.py.

Findings are ``xfail(strict=True)``: they fail on the code reviewed. Controls pass."""

from __future__ import annotations

import copy
import ctypes
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture, _engine
from cudagraphify._capture import MULTI_STREAM
from test_region_alias import _PAUSES
from test_review_plan import _Ctx, _OpaqueRoot
from test_review_usercapture import (_UserStreams, _a_captures_on_the_stream_that_replayed_last,
                                     _two_threads)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _DeviceSyncs(_UserStreams):
    """``_UserStreams`` that records device-wide host waits made while another thread is
    inside a capture of its own: ``capture`` (CudaBackend.capture's ``torch.cuda.synchronize()``
    before ``capture_begin``) and ``drain_all`` (``torch.cuda.synchronize(device)``)."""

    def __init__(self):
        super().__init__()
        self.device_syncs: list[tuple[str, str]] = []

    def _sync(self, what):
        me = threading.current_thread().name
        if self.user - {me}:
            self.device_syncs.append((me, what))

    def capture(self, fn, device, pool=None, keep_graph=False):
        self._sync("capture")
        return super().capture(fn, device, pool, keep_graph)

    def drain_all(self, device):
        self._sync("drain_all")


@pytest.fixture
def syncs():
    backend = _DeviceSyncs()
    old = _capture.set_backend(backend)
    try:
        yield backend
    finally:
        _capture.set_backend(old)
        _PAUSES.clear()


def _pieces_pair():
    torch.manual_seed(0)
    ref = _OpaqueRoot()
    g = cg.graphify(copy.deepcopy(ref))
    ctx = _Ctx()

    class _Bound(nn.Module):
        def forward(self, x):
            return g(x, ctx)

    class _Ref(nn.Module):
        def forward(self, x):
            return ref(x, ctx)

    return ref, g, ctx, _Bound(), _Ref()


# -- finding 1: a new signature on B is captured during A's capture (device-wide sync) ------

@pytest.mark.xfail(strict=True, reason=(
    "FINDING: while A captures (its own torch.cuda.graph, on the stream that replayed last), "
    "B's calls of a new shape are captured by cudagraphify: CudaBackend.capture begins with "
    "torch.cuda.synchronize() (_capture.py, capture), a device-wide sync that CUDA refuses "
    "while any stream of the device is capturing (raises on B, invalidates A's capture). "
    "CAPTURED_ELSEWHERE is checked in _replay only, not before a first call's capture"))
def test_b_new_signature_is_not_captured_while_a_captures(syncs):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    x5 = torch.randn(5, 8)

    def between():
        return [g(x5) for _ in range(3)]  # (a shape not seen before: first sight, capture)

    captures = []

    def counted():
        c = cg.stats(g).captures
        outs = between()
        captures.append(cg.stats(g).captures - c)
        return outs

    out = _a_captures_on_the_stream_that_replayed_last(syncs, g, ref, counted)
    with torch.no_grad():
        assert all(torch.equal(o, ref(x5)) for o in out["b"])
    assert not syncs.device_syncs, (syncs.device_syncs, captures)


@pytest.mark.xfail(strict=True, reason=(
    "FINDING (the same, the commit's control case): A captures on torch.cuda.graph's own "
    "stream, which never replayed g; B's new shape is captured meanwhile: the device-wide "
    "sync of CudaBackend.capture runs during A's capture"))
def test_b_new_signature_is_not_captured_while_a_captures_on_another_stream(syncs):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    inside, done = threading.Event(), threading.Event()
    out = {}

    def a():
        syncs.user.add("A")
        try:
            inside.set()
            assert done.wait(30)
        finally:
            syncs.user.discard("A")

    def b():
        assert inside.wait(30)
        try:
            with torch.no_grad():
                x = torch.randn(5, 8)
                out["ok"] = all(torch.equal(g(x), ref(x)) for _ in range(3))
        finally:
            done.set()

    _two_threads(a, b)
    assert out.get("ok")
    assert not syncs.device_syncs, syncs.device_syncs


# -- finding 2: a release after B's run during A's capture waits on the whole device ---------

@pytest.mark.xfail(strict=True, reason=(
    "FINDING: B's run of a root with pieces during A's capture leaves the implicit region "
    "MULTI_STREAM (exit_run's new branch); a release of a piece's graphs in it meanwhile "
    "(its parameters moved: invalidate -> GraphRegion.forget -> _release -> drain(MULTI) -> "
    "drain_all) is torch.cuda.synchronize(device) during A's capture (refused, as the known "
    "drain of A's own stream in test_review_usercapture)"))
def test_b_release_after_a_multi_stream_exit_does_not_sync_the_device(syncs):
    ref, g, ctx, bound, bref = _pieces_pair()
    xb = torch.randn(4, 8)

    def between_moved():
        first = g(xb, ctx)
        chain = g._cudagraphify_state._chain
        state = (chain._stream_token, set(chain.pending_streams))
        for p in g.a.parameters():
            p.data = p.data.clone()  # (new memory: the piece's graphs are released)
        second = g(xb, ctx)
        return first, second, state

    out = _a_captures_on_the_stream_that_replayed_last(syncs, bound, bref, between_moved)
    first, second, state = out["b"]
    with torch.no_grad():
        assert torch.equal(first, ref(xb, ctx)) and torch.equal(second, ref(xb, ctx))
    assert state[0] == MULTI_STREAM, state
    assert not syncs.device_syncs and ("B", "A") not in out["drains"], \
        (syncs.device_syncs, out["drains"])


# -- controls: ordering after the capture ends; no stale state -------------------------------

def test_control_whole_graph_after_the_capture_orders_once_then_takes_the_fast_path(syncs):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    xb = torch.randn(4, 8)
    after = {}

    def between():
        return g(xb)

    out = _a_captures_on_the_stream_that_replayed_last(syncs, g, ref, between)
    with torch.no_grad():
        assert torch.equal(out["b"], ref(xb))
    state = g._cudagraphify_state
    assert state.eager_calls[_engine.CAPTURED_ELSEWHERE] == 1
    assert state._stream_token == "A"  # (B's eager call did not claim the stream)

    def b_again():
        del syncs.orders[:]
        with torch.no_grad():
            r = state.replays
            after["ok"] = all(torch.equal(g(xb), ref(xb)) for _ in range(3))
            after["replays"] = state.replays - r
        after["orders"] = list(syncs.orders)
        after["fast"] = state._fast is not None

    t = threading.Thread(target=b_again, name="B")
    t.start()
    t.join(30)
    assert after["ok"]
    assert after["orders"] == [("B", "A")], after["orders"]  # (once, then B's own stream)
    assert after["fast"]
    assert state.eager_calls[_engine.CAPTURED_ELSEWHERE] == 1


def test_control_pieces_after_the_capture_order_after_a_and_leave_multi_stream(syncs):
    ref, g, ctx, bound, bref = _pieces_pair()
    xb = torch.randn(4, 8)
    out = _a_captures_on_the_stream_that_replayed_last(syncs, bound, bref,
                                                       lambda: g(xb, ctx))
    chain = g._cudagraphify_state._chain
    assert chain._stream_token == MULTI_STREAM and "A" in chain.pending_streams
    assert ("B", "A") not in out["orders"]
    elsewhere = cg.stats(g.a).eager_calls[_engine.CAPTURED_ELSEWHERE]
    after = {}

    def b_again():
        del syncs.orders[:]
        with torch.no_grad():
            r = cg.stats(g.a).replays
            after["ok"] = all(torch.equal(g(xb, ctx), ref(xb, ctx)) for _ in range(3))
            after["replays"] = cg.stats(g.a).replays - r
        after["orders"] = list(syncs.orders)

    t = threading.Thread(target=b_again, name="B")
    t.start()
    t.join(30)
    assert after["ok"] and after["replays"] >= 3
    assert ("B", "A") in after["orders"], after["orders"]  # (A's queued work first)
    assert after["orders"].count(("B", "A")) == 1, after["orders"]  # (once, not per call)
    assert chain._stream_token == "B" and not chain.pending_streams
    assert cg.stats(g.a).eager_calls[_engine.CAPTURED_ELSEWHERE] == elsewhere


def test_control_a_itself_after_its_capture_orders_after_b(syncs):
    # B's eager run during A's capture made the region MULTI with B pending; A's next run (the
    # capture over) orders after B (whose eager ops may still be queued) and replays
    ref, g, ctx, bound, bref = _pieces_pair()
    xb = torch.randn(4, 8)
    _a_captures_on_the_stream_that_replayed_last(syncs, bound, bref, lambda: g(xb, ctx))
    after = {}

    def a_again():
        del syncs.orders[:]
        with torch.no_grad():
            r = cg.stats(g.a).replays
            x = torch.randn(4, 8)
            after["ok"] = torch.equal(g(x, ctx), ref(x, ctx))
            after["replays"] = cg.stats(g.a).replays - r
        after["orders"] = list(syncs.orders)

    t = threading.Thread(target=a_again, name="A")
    t.start()
    t.join(30)
    assert after["ok"] and after["replays"] >= 1
    assert ("A", "B") in after["orders"], after["orders"]
    chain = g._cudagraphify_state._chain
    assert chain._stream_token == "A" and not chain.pending_streams


def test_control_same_stream_path_asks_nothing(syncs, monkeypatch):
    # the common single-stream path: no stream_capturing query per call
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    asked = []
    monkeypatch.setattr(_DeviceSyncs, "stream_capturing",
                        lambda self, d, t: asked.append(t) or False)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
    assert not asked, asked


def test_control_a_thread_that_replayed_last_and_went_away_is_waited_on(syncs):
    # A replays, then is gone (never captured): B's call waits on A's stream and replays (no
    # eager call for a stream that is not capturing)
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))

    def a():
        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(4, 8)
                assert torch.equal(g(x), ref(x))

    out = {}

    def b():
        del syncs.orders[:]
        with torch.no_grad():
            x = torch.randn(4, 8)
            out["ok"] = torch.equal(g(x), ref(x))
        out["orders"] = list(syncs.orders)

    for fn, name in ((a, "A"), (b, "B")):
        t = threading.Thread(target=fn, name=name)
        t.start()
        t.join(30)
    assert out["ok"] and out["orders"] == [("B", "A")]
    assert not cg.stats(g).eager_calls.get(_engine.CAPTURED_ELSEWHERE)


# -- CudaBackend.stream_capturing, without a GPU (the driver call faked) ----------------------

def _fake_query(rc, status):
    def query(stream, out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = status
        return rc
    return query


def test_control_stream_capturing_tokens_0_and_multi_ask_nothing(monkeypatch):
    asked = []
    monkeypatch.setattr(_capture, "_stream_capture_query", lambda: asked.append(1))
    backend = _capture.CudaBackend()
    dev = torch.device("cuda", 0)
    assert backend.stream_capturing(dev, 0) is False
    assert backend.stream_capturing(dev, MULTI_STREAM) is False
    assert not asked


@pytest.mark.parametrize("status", [0, 1, 2])
def test_control_stream_capturing_reads_the_driver_status(monkeypatch, status):
    calls = []

    def query(stream, out):
        calls.append(stream.value)
        return _fake_query(0, status)(stream, out)

    monkeypatch.setattr(_capture, "_stream_capture_query", lambda: query)
    assert _capture.CudaBackend().stream_capturing(torch.device("cuda", 0), 0x1234) is \
        (status != 0)
    assert calls == [0x1234]


def test_control_stream_capturing_falls_back_when_the_driver_call_fails(monkeypatch):
    # (a CUDA error, e.g. 201 CUDA_ERROR_INVALID_CONTEXT: the stream made current a moment)
    monkeypatch.setattr(_capture, "_stream_capture_query", lambda: _fake_query(201, 1))
    made = []

    class _Ext:
        def __init__(self, token, device=None):
            made.append((token, device))

    class _Ctx:
        def __init__(self, s):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(torch.cuda, "ExternalStream", _Ext)
    monkeypatch.setattr(torch.cuda, "stream", _Ctx)
    monkeypatch.setattr(_capture, "_stream_capturing", lambda: True)
    dev = torch.device("cuda", 1)
    assert _capture.CudaBackend().stream_capturing(dev, 0x55) is True
    assert made == [(0x55, dev)]
