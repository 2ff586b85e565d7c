"""Review of 7299dd8 (a pending backward's eager fast path, ``EagerFast.call`` with ``still``
set, no longer checks the module-state guard nor ``statics_same()``). Findings first (each
fails on 7299dd8 and passes on its parent ab9be26; 7299dd8 was reverted for them), then
controls (two of them strict xfails: what 7299dd8 improved and its revert undid). CPU only,
through the simulated backend (``sim``)."""

from __future__ import annotations

import copy
import gc
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from test_review_pending import _make_pending, _one_graph_in_flight, _pending  # (one definition)


@pytest.fixture(autouse=True)
def _no_warnings_leak():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _net(seed=0, drop=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(drop), nn.Linear(8, 4))


class Scaled(nn.Module):
    """A forward that reads a Python attribute (guarded by the entry's module-state guard)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.lin(x) * self.scale


def _flip(how, mods, on):
    for mod in mods:
        if how == "eval":
            mod.train(not on)
        else:
            mod.scale = 2.0 if on else 1.0


def _two_states(how):
    """A module with a training graph for each of two module states (train/eval, or a Python
    attribute), each captured, replayed and backpropagated; left in the first state."""
    ref = _net() if how == "eval" else Scaled()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    for on in (True, False):
        _flip(how, (m, ref), on)
        for _ in range(2):
            m(x).sum().backward()
    assert cg.stats(m).captures == 2, cg.stats(m)
    return ref, m, x


# -- findings ---------------------------------------------------------------------------------


# A: the module state is part of which graph a call replays. While the first state's graph is
# pending, a call in the other state (model.eval(), an attribute flag) has a graph of its own
# that is not pending; the slow path replays it (the control below), and so did the pending fast
# path before 7299dd8 (its state guard missed). Now it runs eagerly, and is counted under
# PENDING ("the backward of an earlier call with this signature has not run yet"), which is
# false for that call's own graph: the same class as helper-31's F1 (flags) and F2 (grad
# pattern), fixed by checking them in ``_still_pending``.
@pytest.mark.parametrize("how", ["eval", "attr"])
def test_other_module_state_replays_its_own_graph_while_the_first_is_pending(sim, how):
    ref, m, x = _two_states(how)
    _flip(how, (m, ref), False)
    kept = _make_pending(m, x)
    _flip(how, (m, ref), True)
    r, n = cg.stats(m).replays, _pending(m)
    y = m(x)
    assert torch.equal(y, ref(x)) and kept is not None
    assert _pending(m) == n, "counted as a pending backward's call"
    assert cg.stats(m).replays == r + 1, cg.stats(m)


@pytest.mark.parametrize("how", ["eval", "attr"])
def test_control_other_module_state_replays_on_the_slow_path(sim, how):
    ref, m, x = _two_states(how)
    _flip(how, (m, ref), False)
    m(x).sum().backward()
    kept = m(x)  # pending, no EagerFast yet
    _flip(how, (m, ref), True)
    r = cg.stats(m).replays
    y = m(x)
    assert torch.equal(y, ref(x)) and kept is not None
    assert cg.stats(m).replays == r + 1, cg.stats(m)


# B: a ``.data`` swap while pending, then a call (now eager on the fast path, so nothing is
# invalidated), then the kept output's backward: the backward finds the statics moved and calls
# ``refuse_training(MOVED_IN_BACKWARD)``, so every later training call of the module runs
# eagerly, for good (the FSDP2 message, though no FSDP is in sight). Before 7299dd8 that call
# reached the slow path, which invalidated the graphs: the backward raised "released", training
# was not refused, and the next steps captured and replayed again.
def test_data_swap_while_pending_then_backward_does_not_refuse_training_for_good(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    for mod in (m, ref):
        mod[0].weight.data = mod[0].weight.data.clone() * 2
    assert torch.equal(m(x), ref(x))  # the call in between
    with pytest.raises(cg.CudagraphifyError):
        kept.sum().backward()
    del kept
    gc.collect()
    for _ in range(3):  # later training steps
        m.zero_grad(), ref.zero_grad()
        m(x).sum().backward()
        ref(x).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    state = m._cudagraphify_state
    assert state.train_eager is None, state.train_eager
    assert cg.stats(m).replays >= 1, cg.stats(m)


# C: memory. A module change while pending no longer reaches the slow path: the graphs that
# read the old memory (every signature's, not only the pending one) and the statics' hold on the
# old parameter storages (``Statics._held``) stay until the pending ends (the kept output's
# backward or death: an output kept under grad mode for logging may live a long time). Before
# 7299dd8 the first call after the change released them.
def test_graphs_of_a_moved_module_are_released_by_the_next_call_while_pending(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    big = torch.randn(64, 4)
    with torch.no_grad():  # another signature's graph (an inference graph)
        m(big), m(big)
    state = m._cudagraphify_state
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    before = state.cache.graphs(state)
    assert len(before) == 2
    old = m[0].weight.data.untyped_storage()._cdata
    m[0].weight.data = m[0].weight.data.clone()
    m(x)  # eager either way (pending): does it let go of the old memory?
    held = {s._cdata for s in state.statics._held}
    assert old not in held, "the old weight's storage is still held by the statics"
    now = state.cache.graphs(state)
    assert not any(g is h for g in before for h in now), "graphs of the old memory still held"
    assert kept is not None


# -- controls ---------------------------------------------------------------------------------


def test_control_hooks_added_while_pending_run_and_the_result_is_eager(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    seen = []
    h1 = m[2].register_forward_hook(lambda mod, i, o: seen.append("sub") or o * 3)
    h2 = nn.modules.module.register_module_forward_hook(
        lambda mod, i, o: seen.append(type(mod).__name__) or None)
    try:
        y = m(x)
        assert "sub" in seen and "Sequential" in seen
        h2.remove()
        seen.clear()
        y2 = m(x)
        assert seen == ["sub"]
    finally:
        h1.remove()
        h2.remove()
    want = ref[2](ref[1](ref[0](x))) * 3
    assert torch.equal(y, want) and torch.equal(y2, want) and kept is not None
    del kept
    gc.collect()
    assert torch.equal(m(x), ref(x))


def test_control_root_hook_while_pending_runs(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    h = m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    try:
        assert torch.equal(m(x), ref(x * 2))
    finally:
        h.remove()
    assert torch.equal(m(x), ref(x)) and kept is not None


def test_control_no_grad_between_and_replay_after(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    assert torch.equal(m(x), ref(x))
    kept.sum().backward()
    r = cg.stats(m).replays
    y = m(x)
    assert torch.equal(y, ref(x)) and cg.stats(m).replays == r + 1


def test_control_dropout_while_pending_is_eagers(sim):
    ref = _net(drop=0.5)
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    for seed in range(3):
        torch.manual_seed(seed)
        y = m(x)
        torch.manual_seed(seed)
        assert torch.equal(y, ref(x))
    assert kept is not None


_RELEASED = "known, loud: parameters replaced while a backward is pending (load_state_dict(assign=True)) make the next call release the graphs, the pending one too, and its backward raises that it was released where eager's reaches the old parameters; the commit that kept the pending graph (7299dd8) was reverted for its own regressions (the findings above)"


@pytest.mark.parametrize("how", ["data", pytest.param("assign", marks=pytest.mark.xfail(
    strict=True, reason=_RELEASED)), "eval"])
def test_control_changes_during_gradient_accumulation_give_eagers_grads(sim, how):
    """Micro-batches: the first call replays (its backward pending), the others run eagerly;
    a change between micro-batches; one backward. Gradients are eager's or an error (never a
    wrong gradient); the next steps are eager's."""
    ref = _net(drop=0.0)
    m = cg.graphify(copy.deepcopy(ref))
    xs = [torch.randn(3, 4) for _ in range(3)]
    for _ in range(2):
        m(xs[0]).sum().backward()
        ref(xs[0]).sum().backward()
    for step in range(3):
        m.zero_grad(), ref.zero_grad()
        outs, wants = [], []
        for i, x in enumerate(xs):
            if step == 1 and i == 2:
                if how == "data":
                    for mod in (m, ref):
                        mod[0].weight.data = mod[0].weight.data.clone() * 0.5
                elif how == "assign":
                    sd = {k: v.clone() * 0.5 for k, v in ref.state_dict().items()}
                    m.load_state_dict(sd, assign=True)
                    ref.load_state_dict(sd, assign=True)
                else:
                    m.eval(), ref.eval()
            outs.append(m(x))
            wants.append(ref(x))
            assert torch.equal(outs[-1], wants[-1])
        sum(w.sum() for w in wants).backward()
        try:
            sum(o.sum() for o in outs).backward()
        except cg.CudagraphifyError:
            assert how == "data" and step == 1
            continue
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.xfail(strict=True, reason=_RELEASED)
def test_control_assign_while_pending_backward_reaches_the_old_parameters(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    out = m(x)
    out.sum().backward()
    ref(x).sum().backward()
    m.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    kept, kept_ref = m(x), ref(x)
    m(x)  # EagerFast.pending
    old_m, old_ref = list(m.parameters()), list(ref.parameters())
    sd = {k: v.clone() + 1 for k, v in ref.state_dict().items()}
    m.load_state_dict(sd, assign=True)
    ref.load_state_dict(sd, assign=True)
    assert torch.equal(m(x), ref(x))
    kept.sum().backward()
    kept_ref.sum().backward()
    for p, q in zip(old_m, old_ref):
        torch.testing.assert_close(p.grad, q.grad)
    assert all(p.grad is None for p in m.parameters())
    for _ in range(2):
        assert torch.equal(m(x), ref(x))


def test_control_threads_on_the_pending_fast_path(sim):
    ref = _net()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    want = ref(x)
    bad, n0 = [], _pending(m)

    def work():
        for _ in range(200):
            if not torch.equal(m(x), want):
                bad.append(1)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad and kept is not None
    assert _pending(m) - n0 <= 800


def test_control_fast_path_releases_nothing_it_did_not_hold_before(sim):
    """The EagerFast holds the pending entry (as before 7299dd8); once the output dies, the next
    call drops it."""
    m = cg.graphify(_net())
    x = torch.randn(3, 4)
    kept = _make_pending(m, x)
    fast = m._cudagraphify_state._fast
    assert fast.entry is not None
    del kept
    gc.collect()
    m(x)
    assert m._cudagraphify_state._fast is not fast
