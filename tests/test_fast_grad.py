"""The replay fast path under grad mode (cudagraphify/_fast.py): an inference graph (no tensor
of the call needs grad) called with grad mode on replays through it, and every call that the
slow path would decide otherwise misses it: a parameter that requires grad from now on, an
input that requires grad, saved-tensor hooks, training refused, grad mode turned off."""

from __future__ import annotations

import copy

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._fast import Fast


def _frozen_pair():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    ref.requires_grad_(False)
    return ref, cg.graphify(copy.deepcopy(ref))


def _state(g):
    return g._cudagraphify_state


def _warm(g, ref, calls: int = 4):
    for _ in range(calls):
        x = torch.randn(2, 8)
        out = g(x)
        assert torch.equal(out, ref(x)) and not out.requires_grad


def test_an_inference_graph_called_in_grad_mode_replays_fast(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        _warm(g, ref)
        assert type(_state(g)._fast) is Fast
        before = cg.stats(g).replays
        x = torch.randn(2, 8)
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).replays == before + 1 and type(_state(g)._fast) is Fast
        assert cg.stats(g).eager == 0


def test_a_parameter_that_now_requires_grad_misses_the_inference_graph(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        _warm(g, ref)
        fast = _state(g)._fast
        ref[0].weight.requires_grad_(True)
        g[0].weight.requires_grad_(True)
        x = torch.randn(2, 8)
        out, want = g(x), ref(x)
        assert _state(g)._fast is not fast  # (decided afresh)
        assert out.requires_grad and torch.equal(out, want)
        out.sum().backward()
        want.sum().backward()
        assert torch.equal(g[0].weight.grad, ref[0].weight.grad)


def test_an_input_that_requires_grad_misses_it(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        _warm(g, ref)
        x = torch.randn(2, 8, requires_grad=True)
        out, want = g(x), ref(x)
        assert out.requires_grad and torch.equal(out, want)
        (gx,), (wx,) = torch.autograd.grad(out.sum(), x), torch.autograd.grad(want.sum(), x)
        assert torch.equal(gx, wx)


def test_saved_tensor_hooks_and_refused_training_run_eagerly(sim):
    ref, g = _frozen_pair()
    seen = []
    with torch.enable_grad():
        _warm(g, ref)
        x = torch.randn(2, 8)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t,
                                                      lambda t: t):
            assert torch.equal(g(x), ref(x))
        assert any("saved-tensor hooks" in why for why in cg.stats(g).eager_calls)
        _warm(g, ref, 2)  # (fast again)
        _state(g).refuse_training("refused for this test")
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).eager_calls.get("refused for this test") == 1


def test_grad_mode_off_after_on_is_decided_afresh(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        _warm(g, ref)
        fast = _state(g)._fast
    with torch.no_grad():
        x = torch.randn(2, 8)
        assert torch.equal(g(x), ref(x))
        assert _state(g)._fast is not fast
        _warm(g, ref, 2)
    assert cg.stats(g).eager == 0
