"""A forward that resizes a tensor outliving the call (a plain attribute, a buffer, an argument)
runs its module eagerly, its submodules graphed (RELAYOUT: any in-place or out= op that changes
a layout; tests/test_review_resize.py has the other spellings): a replay resizes nothing, and a
CUDA capture's run would move that memory into the graph's pool without its bytes (GPU:
tests/test_gpu_guards.py::test_6_plain_tensor_attribute_grown_by_resize). A tensor the call
makes and resizes itself, or a resize that changes nothing, leaves the whole forward graphed.
CPU, the simulated backend (it replays what it recorded)."""
import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("sim", "quiet")


class GrowsLog(nn.Module):
    def __init__(self, as_buffer=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        if as_buffer:
            self.register_buffer("log", torch.zeros(0))
        else:
            self.log = torch.zeros(0)

    def forward(self, x):
        h = self.lin(x)
        n = self.log.numel()
        self.log.resize_(n + 4)
        self.log[n:].copy_(h[0])
        return h


class OwnScratch(nn.Module):
    """Resizes only a tensor it makes, and a kept one to the size it has."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kept = torch.rand(4)

    def forward(self, x):
        h = self.lin(x)
        scratch = torch.empty(0)
        scratch.resize_(4)
        scratch.copy_(h[0])
        self.kept.resize_(4)  # (its size already: nothing changes)
        return h * scratch * self.kept


def _calls(ref, g, n=5):
    with torch.no_grad():
        for i in range(n):
            x = torch.randn(2, 4)
            assert torch.equal(g(x), ref(x)), f"call {i}"
            assert torch.equal(g.log if hasattr(g, "log") else g.kept,
                               ref.log if hasattr(ref, "log") else ref.kept), f"state, call {i}"


@pytest.mark.parametrize("as_buffer", [False, True])
@pytest.mark.parametrize("warmups", [1, 3])
def test_a_kept_tensor_grown_by_resize_runs_its_module_eagerly(as_buffer, warmups):
    torch.manual_seed(0)
    ref = GrowsLog(as_buffer)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    _calls(ref, g)
    assert g.log.shape == (20,)
    s = cg.stats(g)
    # (the first call gave the empty log its memory: a set-up, decided again by the next)
    setup = next(k for k in s.eager_calls if "RELAYOUT" in k and "set up" in k)
    reason = next(k for k in s.eager_calls if "RELAYOUT" in k and "piecewise" in k)
    assert "Tensor.resize_" in reason, reason
    assert s.eager_calls[setup] == 1 and s.eager_calls[reason] == 4
    if not as_buffer:  # (a buffer resized moves the statics: the root decides every call)
        assert cg.stats(g.lin).replays >= 2  # (its neighbour stays graphed)


def test_an_argument_resized_in_place_is_not_replayed():
    def grow(buf, x):
        buf.resize_(buf.numel() + 2)
        buf[-2:].copy_(x)
        return x * 2

    g = cg.graphify(grow)
    a, b = torch.zeros(0), torch.zeros(0)
    for _ in range(4):
        x = torch.randn(2)
        assert torch.equal(g(a, x), grow(b, x))
        assert torch.equal(a, b)
    assert cg.stats(g).replays == 0


def test_resizes_of_its_own_tensors_or_to_the_same_size_stay_graphed():
    torch.manual_seed(0)
    ref = OwnScratch()
    g = cg.graphify(copy.deepcopy(ref))
    _calls(ref, g)
    s = cg.stats(g)
    assert s.captures == 1 and s.replays >= 3 and not s.eager_calls, s


def test_an_empty_closure_tensor_grown_by_resize_is_not_replayed():
    """Memory a resize gives an empty tensor from outside the call is not the run's own."""
    log = torch.zeros(0)

    def fn(x):
        n = log.numel()
        log.resize_(n + 2)
        log[n:].copy_(x)
        return x * 2

    g = cg.graphify(fn)
    for i in range(4):
        x = torch.randn(2)
        assert torch.equal(g(x), x * 2)
        assert log.numel() == 2 * (i + 1), f"call {i}: {log.numel()}"
    assert cg.stats(g).replays == 0


def test_a_view_the_call_makes_may_change_its_own_layout():
    """``x.view(...).t_()`` on an argument (or a parameter) changes that view's layout only:
    the forward stays one graph. A view's ``resize_`` that moves the memory it shares with a
    kept tensor does not (tests/test_review_resize.py, "view alias")."""
    class Local(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            v = x.view(4, 2)
            v.t_()
            w = self.lin.weight.view(4, 4)
            w.t_()
            return self.lin(v.t().reshape(2, 4)) + w.sum()

    torch.manual_seed(0)
    ref = Local()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert torch.equal(g(x), ref(x)), i
    s = cg.stats(g)
    assert s.captures == 1 and s.replays == 3 and not s.eager_calls, s


class WritesThenRelays(nn.Module):
    """An in-place op on the kept tensor first (it returns that tensor object), then a change
    of its layout: the object is the kept one, not one the call made."""

    def __init__(self, empty):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kept = torch.zeros(0) if empty else torch.zeros(1, 4)

    def forward(self, x):
        h = self.lin(x)
        self.kept.mul_(1.0)
        if self.kept.numel() == 0 or self.kept.dim() < 2:
            self.kept.resize_(self.kept.numel() + 4)
        else:
            self.kept.unsqueeze_(0)
        return h


@pytest.mark.parametrize("empty", [False, True])
def test_a_layout_change_after_an_in_place_op_on_the_kept_tensor_is_seen(empty):
    torch.manual_seed(0)
    ref = WritesThenRelays(empty)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert torch.equal(g(x), ref(x)), i
            assert g.kept.shape == ref.kept.shape, (i, g.kept.shape, ref.kept.shape)
    assert any("RELAYOUT" in k for k in cg.stats(g).eager_calls), cg.stats(g)
