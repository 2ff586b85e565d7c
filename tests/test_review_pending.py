"""Review of 25d1231 (EagerFast.pending: grad-mode calls whose training graph's backward is
still pending run eagerly on a fast path), by review helper-31: findings F1-F5 and F2b (each
failed on 25d1231 as a strict xfail, fixed since: the comment above each) and passing controls.
CPU only, through the simulated backend (``sim``)."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._engine import PENDING
from cudagraphify._fast import EagerFast
from cudagraphify import _engine


@pytest.fixture(autouse=True)
def _one_graph_in_flight(monkeypatch):
    """These tests are about the calls made while a signature's training graph waits for its
    backward, which run eagerly (on a fast path). Since a second graph of the signature is made
    for such a call (``_engine._IN_FLIGHT`` graphs may wait at once), they keep to one: the
    eager path they test is the one past the last graph in flight (tests/test_in_flight.py)."""
    monkeypatch.setattr(_engine, "_IN_FLIGHT", 1)


@pytest.fixture(autouse=True)
def _no_warnings_leak():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def _pending(m) -> int:
    return cg.stats(m).eager_calls.get(PENDING, 0)


def _spy(m):
    """Count the calls that reach the slow path."""
    state = m._cudagraphify_state
    slow = state.slow
    calls = []
    state.slow = lambda *a: calls.append(1) or slow(*a)
    return calls


def _make_pending(m, x):
    """Capture, replay once with the output kept (its backward pending), then one more
    grad-mode call: EagerFast.pending is installed. Returns the kept output."""
    out = m(x)  # capture
    out.sum().backward()
    kept = m(x)  # replay: pending while ``kept`` lives
    m(x)  # slow path: eager, installs EagerFast.pending
    assert type(m._cudagraphify_state._fast) is EagerFast
    return kept


# -- findings ---------------------------------------------------------------------------------


# (fixed) F1: the pending fast path checks no global flag but grad mode: a call under other ...
def test_flags_call_while_another_flags_entry_is_pending_replays_its_own_graph(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        for _ in range(2):  # capture + replay of the deterministic entry, each backpropagated
            m(x).sum().backward()
        torch.use_deterministic_algorithms(False)
        kept = _make_pending(m, x)  # the other entry's backward is pending
        assert cg.stats(m).captures == 2
        r = cg.stats(m).replays
        torch.use_deterministic_algorithms(True)
        y = m(x)  # not pending: its graph should replay
        assert torch.equal(y, ref(x)) and kept is not None
        assert cg.stats(m).replays == r + 1, cg.stats(m)
    finally:
        torch.use_deterministic_algorithms(was)


def test_control_flags_call_replays_its_own_graph_on_the_slow_path(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        for _ in range(2):
            m(x).sum().backward()
        torch.use_deterministic_algorithms(False)
        m(x).sum().backward()
        kept = m(x)  # pending; no EagerFast yet
        r = cg.stats(m).replays
        torch.use_deterministic_algorithms(True)
        y = m(x)
        assert torch.equal(y, ref(x)) and kept is not None
        assert cg.stats(m).replays == r + 1, cg.stats(m)
    finally:
        torch.use_deterministic_algorithms(was)


def test_control_autocast_call_leaves_the_pending_fast_path(sim):
    """Autocast is seen by the tensor guards (the thread's dispatch keys): the autocast call
    misses the pending fast path and replays its own graph."""
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            m(x).float().sum().backward()
    kept = _make_pending(m, x)
    r = cg.stats(m).replays
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        want = ref(x)
    assert torch.equal(y, want) and kept is not None
    assert cg.stats(m).replays == r + 1


def test_control_autocast_call_replays_its_own_graph_on_the_slow_path(sim):
    """The same call as F1, with the pending fast path not installed (the last call was the
    kept replay itself): the slow path replays the autocast graph."""
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            m(x).float().sum().backward()
    m(x).sum().backward()
    kept = m(x)  # pending; _fast not an EagerFast
    r = cg.stats(m).replays
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        want = ref(x)
    assert torch.equal(y, want) and kept is not None
    assert cg.stats(m).replays == r + 1


# (fixed) F2: the pending fast path does not see which parameters require grad (part of the ...
def test_frozen_layer_call_while_the_unfrozen_signature_is_pending_replays_its_graph(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    for p in m[0].parameters():
        p.requires_grad_(False)
    for _ in range(2):  # capture + replay of the frozen pattern's graph
        m(x).sum().backward()
    for p in m[0].parameters():
        p.requires_grad_(True)
    kept = _make_pending(m, x)
    for p in m[0].parameters():
        p.requires_grad_(False)
    r = cg.stats(m).replays
    y = m(x)
    assert torch.equal(y, ref(x)) and kept is not None
    assert cg.stats(m).replays == r + 1, cg.stats(m)


def test_control_frozen_layer_call_replays_on_the_slow_path(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    for p in m[0].parameters():
        p.requires_grad_(False)
    for _ in range(2):
        m(x).sum().backward()
    for p in m[0].parameters():
        p.requires_grad_(True)
    m(x).sum().backward()
    kept = m(x)  # pending; no EagerFast yet
    for p in m[0].parameters():
        p.requires_grad_(False)
    r = cg.stats(m).replays
    y = m(x)
    assert torch.equal(y, ref(x)) and kept is not None
    assert cg.stats(m).replays == r + 1


# (fixed) F3: graph_region.close() inside its with-block: the slow path raises ('this ...
def test_call_in_a_region_closed_by_hand_raises_as_the_slow_path_does(sim):
    m = cg.graphify(_net())
    x = torch.randn(3, 4)
    with cg.graph_region() as region:
        kept = _make_pending(m, x)
        region.close()
        with pytest.raises(cg.CudagraphifyError, match="closed"):
            m(x)
    assert kept is not None


def test_control_call_in_a_region_closed_by_hand_raises_on_the_slow_path(sim):
    m = cg.graphify(_net())
    x = torch.randn(3, 4)
    with cg.graph_region() as region:
        m(x).sum().backward()
        kept = m(x)  # pending, no EagerFast
        region.close()
        with pytest.raises(cg.CudagraphifyError, match="closed"):
            m(x)
    assert kept is not None


# (fixed) F4: the EagerFast holds the call's non-tensor top-level arguments (a list of ...
def test_pending_fast_path_does_not_keep_a_list_argument_alive(sim):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, xs):
            return self.lin(xs[0]) + xs[1]

    m = cg.graphify(M())
    xs = [torch.randn(3, 4), torch.randn(3, 4)]
    m(xs).sum().backward()
    kept = m(xs)
    m(xs)  # (fixed: installs no pending fast path, which would hold ``xs``)
    assert m._cudagraphify_state._fast is None
    ref = weakref.ref(xs[1])
    del xs, kept
    gc.collect()
    assert ref() is None


# (fixed) F5: inside another graphed callable's warm-up or capture the slow path runs the ...
def _pending_inner(fast: bool):
    """A graphified function whose training graph's backward is pending (its output kept),
    with the pending fast path installed or not: (inner, its state, the output kept)."""
    @cg.graphify
    def inner(h):
        return h * 2 + 1

    x = torch.randn(3, 4, requires_grad=True)
    inner(x).sum().backward()
    kept = inner(x)  # replay: pending
    if fast:
        inner(x)  # installs EagerFast.pending
    return inner, inner._self_dispatch.state, kept


def _run_outer_warmups(inner) -> None:
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return inner(self.lin(x))

    outer = cg.graphify(Outer(), num_warmup_iters=3)
    outer(torch.randn(3, 4))  # its warm-ups run inner (h: (3, 4), requires grad)
    assert cg.stats(outer).captures == 1


def test_calls_inside_an_outer_warmup_are_not_counted_as_eager(sim):
    inner, state, kept = _pending_inner(fast=True)
    assert type(state._fast) is EagerFast
    before = state.eager_calls[PENDING]
    _run_outer_warmups(inner)
    assert kept is not None
    assert state.eager_calls[PENDING] == before, dict(state.eager_calls)


def test_control_calls_inside_an_outer_warmup_uncounted_on_the_slow_path(sim):
    inner, state, kept = _pending_inner(fast=False)  # pending, no EagerFast
    before = state.eager_calls[PENDING]
    _run_outer_warmups(inner)
    assert state.eager_calls[PENDING] == before and kept is not None


# (fixed) F2b: a tensor named in static_argnames is keyed by its address; the pending fast ...
def test_static_tensor_at_another_address_replays_its_own_graph(sim):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mem):
            return self.lin(x) + mem

    ref = M()
    m = cg.graphify(copy.deepcopy(ref), static_argnames=("mem",))
    x = torch.randn(3, 4)
    mem_a, mem_b = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(2):  # mem_b's graph: capture + replay, backpropagated
        m(x, mem=mem_b).sum().backward()
    m(x, mem=mem_a).sum().backward()
    kept = m(x, mem=mem_a)  # pending
    m(x, mem=mem_a)  # (fixed: no pending fast path where arguments are static by address;
    # the slow path, which this is now, replays mem_b's graph: its control before the fix)
    assert m._cudagraphify_state._fast is None
    r = cg.stats(m).replays
    y = m(x, mem=mem_b)
    assert torch.equal(y, ref(x, mem_b)) and kept is not None
    assert cg.stats(m).replays == r + 1, cg.stats(m)


# -- controls ---------------------------------------------------------------------------------


def test_control_pending_fast_path_taken_and_counted(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    calls = _spy(m)
    n = _pending(m)
    outs = [m(x) for _ in range(4)]
    assert calls == [] and _pending(m) == n + 4
    assert all(torch.equal(o, ref(x)) for o in outs) and kept is not None


def test_control_pending_cleared_by_dropping_the_output_replays(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    del kept
    gc.collect()
    r = cg.stats(m).replays
    y = m(x)
    assert torch.equal(y, ref(x)) and cg.stats(m).replays == r + 1
    y.sum().backward()


def test_control_pending_cleared_by_retain_graph_backward_replays(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    kept.sum().backward(retain_graph=True)
    r = cg.stats(m).replays
    assert torch.equal(m(x), ref(x)) and cg.stats(m).replays == r + 1


@pytest.mark.parametrize("how", ["data", "to", "assign", "eval_dropout", "param_set"])
def test_control_module_changes_leave_the_fast_path(sim, how):
    torch.manual_seed(0)
    drop = 0.5 if how == "eval_dropout" else 0.0
    ref = nn.Sequential(nn.Linear(4, 8), nn.Dropout(drop), nn.Linear(8, 4))
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    calls = _spy(m)
    if how == "data":
        for mod in (m, ref):
            mod[0].weight.data = mod[0].weight.data.clone() * 2
    elif how == "to":
        for mod in (m, ref):
            mod.to(torch.float64)
        x = x.double()
    elif how == "assign":
        sd = {k: v.clone() * 3 for k, v in ref.state_dict().items()}
        m.load_state_dict(sd, assign=True)
        ref.load_state_dict(sd, assign=True)
    elif how == "eval_dropout":
        m.eval(), ref.eval()
    elif how == "param_set":
        for mod in (m, ref):
            mod[2].bias = nn.Parameter(mod[2].bias.detach() + 1)
    y = m(x)
    if how != "to":
        assert calls == [1], how  # the fast path missed
    if how in ("data", "assign", "eval_dropout", "param_set"):
        assert torch.equal(y, ref(x)), how
    assert kept is not None


def test_control_input_requires_grad_or_shape_leaves_the_fast_path(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    calls = _spy(m)
    xr = x.clone().requires_grad_(True)
    m(xr).sum().backward()
    assert len(calls) == 1
    m(torch.randn(5, 4))
    assert len(calls) == 2
    m(x.t().contiguous().t())  # another stride
    assert len(calls) == 3 and kept is not None


def test_control_region_entered_or_disabled_leaves_the_fast_path(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    calls = _spy(m)
    with cg.graph_region(enabled=False):
        assert torch.equal(m(x), ref(x))
    assert len(calls) == 1
    with cg.graph_region():
        assert torch.equal(m(x), ref(x))
    assert len(calls) == 2 and kept is not None


def test_control_enabled_false_or_callable_no_pending_fast_path(sim):
    x = torch.randn(3, 4)
    for enabled in (False, lambda: True):
        m = cg.graphify(_net(), enabled=enabled)
        m(x).sum().backward()
        kept = m(x)
        m(x)
        assert not isinstance(m._cudagraphify_state._fast, EagerFast)
        assert kept is not None


def test_control_ungraphify_while_pending(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    cg.ungraphify(m)
    assert torch.equal(m(x), ref(x)) and kept is not None
    # the kept output's backward: the graph was released with the module's graphs
    try:
        kept.sum().backward()
    except cg.CudagraphifyError:
        pass


def test_control_no_grad_and_inference_mode_leave_the_fast_path(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    calls = _spy(m)
    with torch.inference_mode():
        m(x)
    assert len(calls) == 1
    with torch.no_grad():
        m(x)
    assert len(calls) == 2 and kept is not None


def test_control_pending_then_backward_grads_match_eager(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    outs = [m(x) for _ in range(3)]
    wants = [ref(x) for _ in range(3)]
    kept_ref = ref(x)
    for o in outs + [kept]:
        o.sum().backward()
    for w in wants + [kept_ref]:
        w.sum().backward()
    # m had one extra backward earlier (in _make_pending): compare after adding it to ref
    ref(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
