"""An autograd Function's backward that reads a tensor from outside through a helper function
it calls (a global function, a module's function, a static method of another class, a helper
of a helper): the training signature is refused as for a direct read (``_hooks._outside_in``
looks into the functions the backward loads, two levels down, not torch's own). Controls: a
helper that reads only its arguments, and torch's own functions, keep the graph. CPU, on the
simulated backend (``sim``)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import cudagraphify as cg
from cudagraphify._hooks import _outside_in

from test_review_fn import _Lin, _run


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


SCALE = torch.ones(())  # a global tensor the helpers read; the tests rebind it


def _scale(g):
    return g * SCALE


def _scale_twice(g):  # (a helper of a helper)
    return _scale(g) * 1


def _pure(g):  # reads its argument only
    return g * 2


_HELPERS = types.ModuleType("_review_helpers")  # ``helpers.scale(grad)``
_HELPERS.scale = _scale


class _Other:
    @staticmethod
    def scale(g):
        return g * SCALE


def _function(body):
    """An autograd Function (identity forward) whose backward is ``body(grad)``."""
    def backward(ctx, grad):
        return body(grad)
    return type("Fn", (torch.autograd.Function,), {
        "forward": staticmethod(lambda ctx, x: x * 1), "backward": staticmethod(backward)})


class _ByGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return _scale(grad)


class _ByModule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return _HELPERS.scale(grad)


class _ByStaticMethod(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return _Other.scale(grad)


class _TwoDeep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return _scale_twice(grad)


class _Pure(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return _pure(grad) * 0.5 + torch.nn.functional.relu(grad) * 0


def _rebind():
    global SCALE
    SCALE = torch.full((), 5.0)


@pytest.mark.parametrize("fn", [_ByGlobal, _ByModule, _ByStaticMethod, _TwoDeep],
                         ids=["global function", "module's function", "static method",
                              "helper of a helper"])
def test_backward_reading_a_rebound_global_through_a_helper(sim, fn):
    global SCALE
    SCALE = torch.ones(())
    make = type("M", (_Lin,), {"fn": fn})
    s = _run(make, _rebind)  # (gradients as eager's after the rebinding)
    (why,) = s.eager_calls  # (the root runs eagerly; its Linear is a graphed piece)
    assert "backward [PYTHON_STATE]" in why and "the global 'SCALE'" in why \
        and "through" in why, why


def test_without_the_screen_the_helper_case_is_a_stale_gradient(sim, monkeypatch):
    # (what the refusal prevents: the replay's backward multiplies by the captured SCALE)
    global SCALE
    SCALE = torch.ones(())
    monkeypatch.setattr("cudagraphify._first_call.backward_reads", lambda outputs: [])
    make = type("M", (_Lin,), {"fn": _ByGlobal})
    with pytest.raises(AssertionError):
        _run(make, _rebind)


def test_what_the_refusal_names():
    what = _outside_in(_TwoDeep.backward)
    assert what == ("the global 'SCALE', through the global '_scale', through the global "
                    "'_scale_twice'"), what


def test_a_helper_reading_its_arguments_only_keeps_the_graph(sim):
    make = type("M", (_Lin,), {"fn": _Pure})
    s = _run(make, lambda: None)
    assert s.replays >= 2 and not s.eager_calls, s.eager_calls


def test_torch_helpers_are_not_looked_into():
    # (torch's own functions are not screened: their globals are torch's, and walking them
    # would cost every backward that calls F.relu a look at torch's code)
    assert _outside_in(_Pure.backward) is None
