"""Review of 4902dba..HEAD (grad-mode fast path refusals, first-call screens for adopted
trainable modules and enable_grad inside forward, forward-mode AD and torch.func calls run
eagerly, held tensors' requires_grad, the region fast path's slot read through the entry,
DirectCall's ``_is_tracing``, one Fast per piece trial and the flags epoch written back).

Findings are ``xfail(strict=True)``; every other test is a control that passes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import cudagraphify as cg
from cudagraphify import _guards
from cudagraphify._fast import Fast

from test_fast_grad import _frozen_pair, _state, _warm
from test_review_gradfast import _GradInside, _pair_of, _same_autograd

# A user's module that imported the level functions by name before cudagraphify's first capture
# wrapped them (the unwrapped originals, whatever ran before in this process).
from torch.autograd.forward_ad import enter_dual_level as _enter_by_name  # noqa: E402
from torch.autograd.forward_ad import exit_dual_level as _exit_by_name  # noqa: E402

_enter_by_name = getattr(_enter_by_name, "__wrapped__", _enter_by_name)
_exit_by_name = getattr(_exit_by_name, "__wrapped__", _exit_by_name)

pytestmark = pytest.mark.usefixtures("quiet")


# -- enable_grad inside forward under a no_grad caller ----------------------------------------

# (fixed: was a strict xfail of helper-35's review)
def test_f1_enable_grad_inside_frozen_then_unfrozen_under_no_grad(sim):
    _f1_body(calls_after=2)


# (fixed: was a strict xfail of helper-35's review)
def test_f1_slow_path_too(sim, monkeypatch):
    monkeypatch.setattr(Fast, "make", staticmethod(lambda *a, **k: None))
    _f1_body()


def _f1_body(calls_after: int = 1):
    ref, g = _pair_of(_GradInside, frozen=True)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8)
            assert _same_autograd(g(x), ref(x))
        ref.lin.requires_grad_(True)
        g.lin.requires_grad_(True)
        for i in range(calls_after):
            x = torch.randn(2, 8)
            out, want = g(x), ref(x)
            assert want.grad_fn is not None
            assert _same_autograd(out, want), i


def test_enable_grad_inside_trainable_under_no_grad_runs_eagerly(sim):
    # control (the fixed case): trainable from the start -> eager, remembered
    ref, g = _pair_of(_GradInside, frozen=False)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 8)
            out, want = g(x), ref(x)
            assert _same_autograd(out, want), i
            with torch.enable_grad():
                out.sum().backward()
                want.sum().backward()
            assert torch.equal(g.lin.weight.grad, ref.lin.weight.grad)


def test_enable_grad_inside_with_an_input_requiring_grad_later(sim):
    # control: frozen parameters, then an input that requires grad (a new signature)
    ref, g = _pair_of(_GradInside, frozen=True)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8)
            assert _same_autograd(g(x), ref(x))
        for i in range(3):
            x = torch.randn(2, 8, requires_grad=True)
            out, want = g(x), ref(x)
            assert _same_autograd(out, want), i


# -- forward-mode AD ---------------------------------------------------------------------------

# (fixed: was a strict xfail of helper-35's review)
@pytest.mark.parametrize("grad", [False, True])
def test_f2_dual_level_entered_by_a_name_imported_early(sim, grad):
    ref, g = _frozen_pair()
    with torch.set_grad_enabled(grad):
        _warm(g, ref)
        assert type(_state(g)._fast) is Fast
        _enter_by_name()
        try:
            x, t = torch.randn(2, 8), torch.randn(2, 8)
            out = fwAD.unpack_dual(g(fwAD.make_dual(x, t)))
            want = fwAD.unpack_dual(ref(fwAD.make_dual(x, t)))
        finally:
            _exit_by_name()
        assert torch.equal(out.primal, want.primal)
        assert out.tangent is not None and torch.equal(out.tangent, want.tangent)


def test_dual_level_context_after_the_fast_path_keeps_tangents_and_exceptions(sim):
    ref, g = _frozen_pair()
    _warm(g, ref)
    with pytest.raises(ZeroDivisionError):
        with fwAD.dual_level():
            g(torch.randn(2, 8))
            1 / 0
    assert fwAD._current_level == -1
    r = cg.stats(g).replays
    _warm(g, ref, 3)  # out of the level again: replays
    assert cg.stats(g).replays == r + 3
    for _ in range(2):
        with fwAD.dual_level():
            x, t = torch.randn(2, 8), torch.randn(2, 8)
            out = fwAD.unpack_dual(g(fwAD.make_dual(x, t)))
            want = fwAD.unpack_dual(ref(fwAD.make_dual(x, t)))
            assert torch.equal(out.tangent, want.tangent)
        _warm(g, ref, 2)


@pytest.mark.parametrize("api", ["func", "functional"])
def test_jvp_apis_after_the_fast_path(sim, api):
    ref, g = _frozen_pair()
    _warm(g, ref)
    assert type(_state(g)._fast) is Fast
    x, t = torch.randn(2, 8), torch.randn(2, 8)
    if api == "func":
        out = torch.func.jvp(g, (x,), (t,))
        want = torch.func.jvp(ref, (x,), (t,))
    else:
        out = torch.autograd.functional.jvp(g, x, t)
        want = torch.autograd.functional.jvp(ref, x, t)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    _warm(g, ref, 2)


def test_nested_func_jvp_after_the_fast_path(sim):
    ref, g = _frozen_pair()
    _warm(g, ref)
    x, t = torch.randn(2, 8), torch.randn(2, 8)

    def inner(f):
        return lambda y: torch.func.jvp(f, (y,), (t,))[1]

    out = torch.func.jvp(inner(g), (x,), (t,))
    want = torch.func.jvp(inner(ref), (x,), (t,))
    assert torch.allclose(out[1], want[1]) and torch.equal(out[0], want[0])


@pytest.mark.parametrize("grad", [False, True])
def test_vmap_and_func_grad_after_the_fast_path(sim, grad):
    ref, g = _frozen_pair()
    with torch.set_grad_enabled(grad):
        _warm(g, ref)
        xs = torch.randn(3, 2, 8)
        assert torch.equal(torch.func.vmap(g)(xs), torch.func.vmap(ref)(xs))
        x = torch.randn(2, 8)
        assert torch.equal(torch.func.grad(lambda y: g(y).sum())(x),
                           torch.func.grad(lambda y: ref(y).sum())(x))
        _warm(g, ref, 2)


# -- JIT tracing through DirectCall ------------------------------------------------------------

def test_jit_trace_of_a_function_calling_a_graphified_module(sim):
    ref, g = _frozen_pair()
    with torch.no_grad():
        _warm(g, ref)
        traced = torch.jit.trace(lambda x: g(x) * 2, torch.randn(2, 8), check_trace=False)
        for _ in range(2):
            x = torch.randn(2, 8)
            assert torch.equal(traced(x), ref(x) * 2)
        assert torch._C._is_tracing() is False


# -- trial: one Fast for all turns -------------------------------------------------------------

from test_trial import _COST, _Root, timed  # noqa: E402,F401


def test_trial_reused_fast_sees_a_parameter_moved_between_turns(timed):
    _COST.update(graph=5e-6, eager=5e-6)
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    for i in range(12):
        if i == 3:  # mid-trial: a piece's weight in new memory, new values
            w = torch.randn(8, 8)
            ref.a.weight.data = w.clone()
            g.a.weight.data = w.clone()
        if i == 6:  # in place
            ref.b.bias.add_(1)
            g.b.bias.add_(1)
        x = torch.randn(4, 8)
        assert torch.equal(g(x), ref(x)), i


def test_trial_reused_fast_across_explicit_regions(timed):
    _COST.update(graph=5e-6, eager=5e-6)
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    kept = []
    for i in range(10):
        with cg.graph_region():
            x = torch.randn(4, 8)
            out = g(x)
            kept.append((out, ref(x)))
            assert torch.equal(out, kept[-1][1]), i
    for out, want in kept:  # outputs handed out of closed regions are still theirs
        assert torch.equal(out, want)


# -- the flags epoch written back into the entry's FlagsGuard -----------------------------------

def test_flags_epoch_written_back_then_a_flag_set_between_two_states(sim):
    # two graphified modules; each fast path re-reads flags after a setter, one writes its
    # entry's epoch; a flag set afterwards is still seen by both
    ref, g = _frozen_pair()
    ref2, g2 = _frozen_pair()
    _warm(g, ref)
    _warm(g2, ref2)
    old = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = not old
        _warm(g, ref, 1)
        r = cg.stats(g2).replays
        torch.backends.cudnn.benchmark = old
        _warm(g2, ref2, 1)
        assert cg.stats(g2).replays == r + 1
        torch.backends.cudnn.benchmark = not old
        r = (cg.stats(g).replays, cg.stats(g2).replays)
        _warm(g, ref, 1)
        _warm(g2, ref2, 1)
        # the flag differs from both captures: neither replays its old graph
        assert _state(g)._fast is None or _state(g)._fast.entry.flags.flags == \
            _guards.FlagsGuard.read()
    finally:
        torch.backends.cudnn.benchmark = old
