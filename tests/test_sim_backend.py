"""The simulated capture backend (conftest.SimBackend) replays what it captured.

These test the double itself, without the engine: a graph records the aten ops of one run and a
replay runs those ops again on the memory they used, as a CUDA graph does. So a value the forward
read from Python (a module attribute) stays what it was at capture, and a tensor swapped out from
under the graph is not seen by it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg
from cudagraphify._errors import CaptureFailed
from conftest import SimBackend

CPU = torch.device("cpu")


@pytest.fixture
def backend():
    return SimBackend()


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.scale


def test_a_replay_computes_with_the_scalar_the_capture_read(backend):
    m = _Scale()
    x = torch.randn(3)
    g, out = backend.capture(lambda: m(x), CPU)
    assert m.calls == 1 and backend.captures == 1
    m.scale = 0.5
    new = torch.randn(3)
    x.copy_(new)
    g.replay()
    # the captured scale, not the attribute's new value; and no Python of the forward ran
    torch.testing.assert_close(out, new * 2.0, rtol=0, atol=0)
    assert m.calls == 1 and backend.replays == 1


def _step(x, acc, o, w):
    """In-place ops, views, out=, multi-output and list-output ops, and _unsafe_view."""
    acc.add_(x)                          # in place on a buffer: accumulates on every run
    acc[1:3].mul_(2)                     # in place through a view
    t = x.view(2, 2).t()                 # views
    torch.add(x, 1, out=o)               # out=
    vals, idx = torch.max(t, dim=1)      # two outputs
    parts = torch.split(x, 1)            # a list of views
    joined = torch.cat([p * i for i, p in enumerate(parts)])
    mm = torch.matmul(x.view(1, 2, 2), w)  # 3-d @ 2-d: aten._unsafe_view
    return t.sum(0), acc[::2], vals, idx, joined, mm, x


def test_in_place_ops_and_views_replay(backend):
    def state():
        return torch.arange(4.0), torch.zeros(4), torch.empty(4), torch.randn(2, 2)

    mine, ref = state(), None
    ref = tuple(t.clone() for t in mine)
    g, out = backend.capture(lambda: _step(*mine), CPU)
    # a capture runs no kernel: what it wrote into memory it did not make is as it was
    for got, exp in zip(mine, ref):
        torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
    for _ in range(3):
        new = torch.randn(4)
        mine[0].copy_(new)
        ref[0].copy_(new)
        g.replay()
        want = _step(*ref)
        for got, exp in zip(out, want):
            torch.testing.assert_close(got, exp, rtol=0, atol=0)
        for got, exp in zip(mine, ref):  # the buffer the graph writes in place, and out=
            torch.testing.assert_close(got, exp, rtol=0, atol=0)
    assert out[-1] is mine[0]  # an output that is the input itself


def test_a_parameter_swapped_after_capture_is_not_seen_by_a_replay(backend):
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with torch.no_grad():
        g, out = backend.capture(lambda: lin(x), CPU)
        old_w, old_b = lin.weight.detach().clone(), lin.bias.detach().clone()
        lin.weight.data = torch.randn(3, 4)  # the module reads new memory from now on
        lin.bias = nn.Parameter(torch.randn(3))
        x.copy_(torch.randn(2, 4))
        g.replay()
    torch.testing.assert_close(out, F.linear(x, old_w, old_b), rtol=0, atol=0)
    assert not torch.equal(out, lin(x))


def test_a_buffer_resized_in_place_keeps_the_captured_memory_and_layout(backend):
    buf = torch.arange(6.0)
    g, out = backend.capture(lambda: buf * 2, CPU)
    buf.resize_(2, 2)  # smaller: the same memory, another shape on the Python tensor
    buf.fill_(1.0)
    g.replay()  # reads the 6 captured elements, 4 of them now ones
    torch.testing.assert_close(out, torch.tensor([2.0, 2, 2, 2, 8, 10]), rtol=0, atol=0)


def test_a_buffer_whose_memory_was_reallocated_after_capture_fails_the_replay(backend):
    buf = torch.arange(4.0)
    g, _ = backend.capture(lambda: buf * 2, CPU)
    buf.resize_(1000)  # larger: the storage moves; a CUDA graph would read the freed memory
    with pytest.raises(AssertionError, match="stale replay"):
        g.replay()


def test_dropout_draws_new_numbers_on_every_replay(backend):
    drop = nn.Dropout(0.5).train()
    x = torch.ones(1000)
    g, out = backend.capture(lambda: drop(x), CPU)
    seen = [out.clone()]
    for _ in range(3):
        g.replay()
        assert set(out.unique().tolist()) == {0.0, 2.0}
        assert not any(torch.equal(out, s) for s in seen)
        seen.append(out.clone())


def test_a_training_capture_replays_its_forward_and_backward(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    params = list(model.parameters())
    x = torch.randn(3, 4, requires_grad=True)
    fwd, y = backend.capture(lambda: model(x), CPU)
    grad_out = torch.empty_like(y)
    bwd, grads = backend.capture(
        lambda: torch.autograd.grad([y], [x, *params], [grad_out]), CPU)
    assert bwd._ops, "the backward's ops were recorded (autograd ran on this thread)"
    for _ in range(3):
        new_x, new_g = torch.randn(3, 4), torch.randn(3, 2)
        with torch.no_grad():
            x.copy_(new_x)
            grad_out.copy_(new_g)
        fwd.replay()
        bwd.replay()
        xr = new_x.clone().requires_grad_(True)
        yr = model(xr)
        want = torch.autograd.grad([yr], [xr, *params], [new_g])
        torch.testing.assert_close(y, yr, rtol=0, atol=0)
        for got, exp in zip(grads, want):
            torch.testing.assert_close(got, exp, rtol=0, atol=0)


def test_a_host_sync_in_the_captured_function_makes_replay_fail(backend):
    x = torch.randn(3)
    g, out = backend.capture(lambda: x * x.sum().item(), CPU)  # captures on a CPU
    assert g.unreplayable == ["aten._local_scalar_dense.default"]
    with pytest.raises(AssertionError, match="_local_scalar_dense"):
        g.replay()


def test_capture_failures_release_and_the_capture_flag(backend):
    flags = []

    def fails():
        flags.append(backend.in_capture())
        raise ValueError("boom")

    with pytest.raises(CaptureFailed, match="ValueError: boom"):
        backend.capture(fails, CPU)
    assert flags == [True] and not backend.in_capture() and backend.captures == 0
    g, _ = backend.capture(lambda: torch.ones(2) + 1, CPU)
    assert backend.graphs == [g] and g.pool_bytes == 16  # what the capture allocated: 2 x 8
    g.release()
    assert g.released
    with pytest.raises(AssertionError, match="released"):
        g.replay()


def test_a_replay_inside_inference_mode_and_autocast_runs_the_captured_ops(backend):
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        g, out = backend.capture(lambda: lin(x).add_(1), CPU)
    x.copy_(torch.randn(2, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # not captured: a replay ignores it
        g.replay()
    with torch.no_grad():
        torch.testing.assert_close(out, lin(x) + 1, rtol=0, atol=0)


def test_a_graphed_module_called_inside_a_capture_runs_eagerly_as_part_of_it(sim):
    inner = cg.graphify(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with torch.no_grad():
        g, out = sim.capture(lambda: inner(x) * 2, CPU)
        # the engine asked in_capture(): no warm-up or capture of its own, its ops are the graph's
        s = cg.stats(inner)
        assert (s.captures, s.replays, s.eager_calls, sim.captures) == (0, 0, {}, 1), s
        x.copy_(torch.randn(2, 4))
        g.replay()
        torch.testing.assert_close(out, F.linear(x, inner.weight, inner.bias) * 2, rtol=0,
                                   atol=0)
