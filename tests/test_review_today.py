"""Review of the commits after 8976a5e (pieces given back on host time and the implicit region
skipped, the fast path's hand-taken locks, a segments plan that saw a direct launch).

CPU tests on the simulated backend (tests/conftest.py), by review helper-30: findings F1a, F1b
and F3 (each failed on e2c995a, fixed since) and controls. The profiler branch of a segments
record needs CUDA: the F3 tests stand in for it with the same calls (``no_segments``); GPU
scripts in the session's review8 ran the real one."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _nested, _segmodes, _segrun

# the fake device and host clocks, the pieces, and the fixture ``timed`` of tests/test_trial.py
from test_trial import _COST, _Piece, _Root
from test_trial import timed  # noqa: F401 (a fixture)


class _RootWithUserGraphed(nn.Module):
    """``a``: a piece of the root's plan; ``c``: graphified by the user before the root (so no
    piece), its output returned as it is."""

    def __init__(self):
        super().__init__()
        self.a, self.c = _Piece(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):  # a host sync
            y = y + 1
        return self.c(y)


def _calls(g, ref, n=10, rows=4):
    for _ in range(n):
        x = torch.randn(rows, 8)
        got, want = g(x), ref(x)
        assert torch.equal(got, want), (got - want).abs().max()


def _given_back_pair(root_cls=_Root, before=None):
    """Root and graphified copy, run until both pieces are given back on host time."""
    _COST.update(graph=9.8e-6, eager=10e-6, graph_host=8e-6, eager_host=5e-6)
    torch.manual_seed(0)
    ref = root_cls()
    copy_ = copy.deepcopy(ref)
    if before is not None:
        before(copy_)
    g = cg.graphify(copy_)
    _calls(g, ref)
    return ref, g


# == item 1: pieces given back, the implicit region skipped =====================================

def test_control_all_pieces_given_back_skip_the_region_and_equal_eager(timed):  # noqa: F811
    ref, g = _given_back_pair()
    state = g._cudagraphify_state
    assert g.a._cudagraphify_state.given_back and g.b._cudagraphify_state.given_back
    assert state._chain_needed() is False
    chain = state._chain
    replays = chain.replays if chain is not None else 0
    _calls(g, ref, n=3)
    assert (chain.replays if chain is not None else 0) == replays


def test_control_a_piece_given_back_for_one_signature_only_stays_live(timed):  # noqa: F811
    """A piece whose graph of one signature did not pay (an EagerEntry for that key) is not
    ``given_back``: the region stays."""
    _COST.update(graph=1e-6, eager=50e-6)  # the first signature pays
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    _calls(g, ref, n=10, rows=4)
    _COST.update(graph=50e-6, eager=1e-6)  # the second does not
    _calls(g, ref, n=10, rows=3)
    sa = g.a._cudagraphify_state
    assert sa.given_back is None
    assert any(r.startswith("signature run eagerly") for r in sa.eager_calls), sa.eager_calls
    assert g._cudagraphify_state._chain_needed() is True
    _calls(g, ref, n=3, rows=4)
    _calls(g, ref, n=3, rows=3)


def test_control_a_piece_added_later_resets_the_cache(timed):  # noqa: F811
    ref, g = _given_back_pair()
    state = g._cudagraphify_state
    assert state._chain_needed() is False
    extra = nn.Linear(8, 8)
    state._add_pieces([extra])  # (a later plan's piece: no state yet, so live)
    assert state._chain_needed() is True


def test_F1a_a_piece_graphified_again_is_seen_live(timed):  # noqa: F811
    """Found on e2c995a (_chain_needed cached False until a piece anywhere was given back: a
    piece re-graphified by hand, a new state not given back, was not seen); fixed in 397e807
    (a state made moves _trial.pieces_epoch)."""
    ref, g = _given_back_pair()
    state = g._cudagraphify_state
    assert state._chain_needed() is False
    assert "forward" not in g.a.__dict__  # (given back: its plain forward, not graphified)
    cg.graphify(g.a)
    _calls(g, ref, n=3)
    assert g.a._cudagraphify_state.given_back is None  # live: graphs of its own
    assert cg.stats(g.a).graphs >= 1
    assert state._chain_needed() is True


def _user_graphed_c(m):
    # the user graphifies a submodule themselves, keeping its outputs (copy_outputs=False)
    cg.graphify(m.c, copy_outputs=False)


def test_F1b_root_output_stays_after_pieces_given_back(timed):  # noqa: F811
    # (fixed: the implicit region stays while a graphed callable that is not a piece, ``c``,
    # has graphs in it; its outputs are copied on the way out as before)
    ref, g = _given_back_pair(_RootWithUserGraphed, before=_user_graphed_c)
    assert g.a._cudagraphify_state.given_back is not None
    assert g._cudagraphify_state._chain_needed() is True
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    out1 = g(x1)
    want1 = ref(x1)
    assert torch.equal(out1, want1)
    g(x2)  # the user's next call
    assert torch.equal(out1, want1), "the first call's result changed under the caller"


def test_F1b_control_while_a_piece_is_live_the_region_copies(timed):  # noqa: F811
    """The same model while its piece keeps its graph: the implicit region hands back copies."""
    _COST.update(graph=1e-6, eager=50e-6)
    torch.manual_seed(0)
    ref = _RootWithUserGraphed()
    m = copy.deepcopy(ref)
    _user_graphed_c(m)
    g = cg.graphify(m)
    _calls(g, ref)
    assert g._cudagraphify_state._chain_needed() is True
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    out1 = g(x1)
    want1 = ref(x1)
    g(x2)
    assert torch.equal(out1, want1)


# == item 2: the fast path's locks, taken by hand =============================================

def _free_elsewhere(*locks) -> bool:
    """Whether another thread can take each of ``locks`` at once (none leaked)."""
    ok = []

    def probe():
        for lock in locks:
            got = lock.acquire(timeout=1.0)
            ok.append(got)
            if got:
                lock.release()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return all(ok) and len(ok) == len(locks)


@pytest.fixture
def quiet_sim(sim):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield sim


@pytest.mark.parametrize("in_region", [False, True])
def test_control_fast_path_replay_and_misses_release_both_locks(quiet_sim, in_region):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    g = cg.graphify(copy.deepcopy(ref))
    region = cg.graph_region() if in_region else None
    with region if region is not None else torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(g(x).clone(), ref(x))
        state = g._cudagraphify_state
        fast = state._fast
        assert fast is not None and (fast.outer is region.lock if in_region
                                     else fast.outer is None)
        locks = (state.lock, *((region.lock,) if in_region else ()))
        assert _free_elsewhere(*locks)
        # misses inside the locks: another shape; a changed flag epoch read again
        x = torch.randn(3, 8)
        assert torch.equal(g(x).clone(), ref(x))
        assert _free_elsewhere(*locks)
        for _ in range(2):
            x = torch.randn(4, 8)
            assert torch.equal(g(x).clone(), ref(x))
        assert state._fast is not None
        torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark  # (a setter: epoch)
        x = torch.randn(4, 8)
        assert torch.equal(g(x).clone(), ref(x))
        assert _free_elsewhere(*locks)


@pytest.mark.parametrize("in_region", [False, True])
def test_control_fast_path_exception_in_the_replay_releases_both_locks(quiet_sim, monkeypatch,
                                                                        in_region):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    g = cg.graphify(copy.deepcopy(ref))
    region = cg.graph_region() if in_region else None
    with region if region is not None else torch.no_grad():
        for _ in range(4):
            g(torch.randn(4, 8))
        state = g._cudagraphify_state
        assert state._fast is not None
        entry = state._fast.entry
        replay = entry._replay  # (the bound replay the entry calls)

        def boom():
            raise RuntimeError("replay failed")

        entry._replay = boom
        from cudagraphify import _fast
        seen = []
        call = _fast.Fast.call
        monkeypatch.setattr(_fast.Fast, "call", lambda self, *a: seen.append(1) or call(self, *a))
        with pytest.raises(RuntimeError, match="replay failed"):
            g(torch.randn(4, 8))
        assert seen  # (raised on the fast path)
        locks = (state.lock, *((region.lock,) if in_region else ()))
        assert _free_elsewhere(*locks)
        entry._replay = replay
        x = torch.randn(4, 8)
        assert torch.equal(g(x).clone(), ref(x))


def test_control_fast_path_waits_for_a_region_held_by_another_thread(quiet_sim):
    """A region's lock held by another thread: the fast path waits for it (it does not skip
    it), then replays."""
    import time
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    with cg.graph_region() as region:
        for _ in range(3):
            g(torch.randn(4, 8))
        assert g._cudagraphify_state._fast is not None
        held, events = threading.Event(), []

        def hold():
            with region.lock:
                held.set()
                time.sleep(0.3)
                events.append("released")

        t = threading.Thread(target=hold)
        t.start()
        held.wait()
        x = torch.randn(4, 8)
        out = g(x).clone()
        events.append("replayed")
        t.join()
        assert events == ["released", "replayed"]
        assert torch.equal(out, ref(x))


# == item 3: a segments plan whose record saw a direct kernel launch ==========================
#
# The profiler branch of SegmentPlan.record needs a CUDA device; on the CPU double the record
# below is that branch as HEAD has it (record under the mode, then, the profiler having found a
# direct launch: unseen, seen_unseen, ready, earlier dropped, return), or the branch where the
# profiler could not be started (no mode: unseen only).

_WHY = ("cuLaunchKernel ran outside every torch call the mode sees (a C++ or Triton kernel "
        "called directly): a graphed segment would not see its work")


def _profiled_record(found: bool):
    records = []
    original = _segrun.SegmentPlan.record

    def record(self, fn, args, kwargs, earlier=None, dry=False):
        records.append(dry)
        if dry:  # (a dry record runs without the profiler: as on the CPU)
            return original(self, fn, args, kwargs, earlier=earlier, dry=dry)
        self.dry, self.earlier = dry, earlier
        if found:  # (the profiler ran: the record under the mode, as on CUDA)
            with _nested.Nested(), _segmodes._Recorder(self):
                out = fn(*args, **kwargs)
            self.no_segments(_WHY, seen=True)
        else:  # (it could not be started)
            with _nested.Nested():
                out = fn(*args, **kwargs)
            self.no_segments("the profiler could not be started (it finds kernels the mode "
                             "does not see)", seen=False)
        return out

    return record, records


class _Synced(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x).relu() + 1
        if h.sum().item() > -1e30:  # a host sync: the root runs piecewise
            h = h * 2
        return self.b(h) - 1


@pytest.fixture
def seg(sim, segments_enabled):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield sim


def _seg_run(monkeypatch, found: bool, calls: int):
    record, records = _profiled_record(found)
    monkeypatch.setattr(_segrun.SegmentPlan, "record", record)
    torch.manual_seed(0)
    ref = _Synced().eval()
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(calls):
        x = torch.randn(4, 16)
        got, want = g(x), ref(x)
        assert torch.equal(got, want)
    return g, records


def test_control_seen_unseen_runs_without_segments_and_records_once(seg, monkeypatch):
    g, records = _seg_run(monkeypatch, found=True, calls=8)
    assert records == [False]  # (call 1 decided the signature, call 2 recorded)
    items = list(g._cudagraphify_state.segments._plans.values())
    assert [it[2] for it in items] == [1] and items[0][1].seen_unseen
    assert cg.stats(g).segments == 0 and cg.stats(g).segment_replays == 0


def test_control_a_profiler_that_could_not_start_is_tried_again(seg, monkeypatch):
    g, records = _seg_run(monkeypatch, found=False, calls=8)
    # (the plan has no flags guard: invalid, recorded again next call, up to MAX_PLANS)
    assert records == [False] * _segrun.MAX_PLANS, records
    assert cg.stats(g).segment_replays == 0


def _held_bytes(plan) -> int:
    held = sum(t.nbytes for c in plan.calls for t in c.eager_out)
    held += sum(r[2].nbytes for c in plan.calls for r in c.refs
                if len(r) > 2 and isinstance(r[2], torch.Tensor))
    held += sum(st.nbytes() for st in plan.copied_held)
    return held


def test_F3_a_seen_unseen_plan_holds_no_copies_of_its_record(seg, monkeypatch):
    # (fixed: the plan is kept for good, so it keeps nothing of its record)
    g, _ = _seg_run(monkeypatch, found=True, calls=8)
    (plan,) = g._cudagraphify_state.segments.plans()
    assert plan.seen_unseen
    assert _held_bytes(plan) == 0, f"{_held_bytes(plan)} bytes of the record kept"


def test_F3_the_recorded_calls_input_is_not_kept(seg, monkeypatch):
    record, _ = _profiled_record(True)
    monkeypatch.setattr(_segrun.SegmentPlan, "record", record)
    torch.manual_seed(0)
    ref = _Synced().eval()
    g = cg.graphify(copy.deepcopy(ref))
    g(torch.randn(4, 16))  # decides the signature
    x = torch.randn(4, 16)
    g(x)  # recorded
    ptr = x.untyped_storage().data_ptr()
    del x
    for _ in range(5):
        g(torch.randn(4, 16))
    (plan,) = g._cudagraphify_state.segments.plans()
    assert all(st.data_ptr() != ptr for st in plan.copied_held)
