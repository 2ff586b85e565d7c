"""Review of aa9f958, fad52b5, 8c33b30, d1e3dc6 (held tensors put back by value around the whole
capture; share_graph refuses a forward that writes a held tensor; bucketed keeps four states
per size and the training flag in its key), on the simulated backend.

Six findings were fixed after the review (marked where their strict xfails were); one
remains a strict xfail (documented); the rest are controls.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg
from conftest import SimBackend
from cudagraphify import _capture
from cudagraphify._errors import CaptureFailed
from test_review_final import Hits
from test_share_engine import _distinct, _register, reading  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("quiet")


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# -- held tensors put back around the capture (aa9f958, 8c33b30) -----------------------------


class MetaRef(nn.Module):
    """Keeps a meta tensor as a plain attribute (a shape template) and reads it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.proto = torch.empty(4, device="meta")

    def forward(self, x):
        return self.lin(x) + self.proto.shape[0]


# (fixed after the review: the finding this test showed passes now)
def test_meta_tensor_attribute_first_call(sim):
    torch.manual_seed(0)
    ref = MetaRef()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i


class Wide(nn.Module):
    """Reads an expanded view of a counter it writes (the view first)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.base = torch.zeros(1)
        self.wide = self.base.expand(4)

    def forward(self, x):
        y = self.lin(x) + self.wide
        self.base.add_(1)
        return y


# (fixed after the review: the finding this test showed passes now)
def test_expanded_held_view_extra_warmup(sim):
    torch.manual_seed(0)
    ref = Wide()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=2)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.base, ref.base), i


def test_expanded_held_view_one_warmup_control(sim):
    torch.manual_seed(0)
    ref = Wide()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.base, ref.base), i


# (fixed after the review: the finding this test showed passes now)
def test_cpu_held_counter_extra_warmups_still_graphed(sim):
    torch.manual_seed(0)
    ref = Hits()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=3)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.hits, ref.hits), i
    assert cg.stats(g).replays > 0


def test_cpu_held_counter_one_warmup_graphed_control(sim):
    torch.manual_seed(0)
    ref = Hits()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.hits, ref.hits), i
    assert cg.stats(g).replays > 0


class BigHits(Hits):
    def __init__(self):
        super().__init__(n=100)  # (not a small CPU tensor: not value-guarded)


@pytest.mark.parametrize("warmups", [1, 3])
def test_held_counter_real_call_write_kept_control(sim, warmups):
    """The real call's write stays; the extra warm-ups' and the capture's go."""
    torch.manual_seed(0)
    ref = BigHits()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.hits, ref.hits), i
    assert cg.stats(g).replays > 0


def test_held_counter_training_control(sim):
    """Training always runs an extra warm-up (its backward): undone too."""
    torch.manual_seed(0)
    ref = BigHits()
    g = cg.graphify(copy.deepcopy(ref))
    for i in range(4):
        x = torch.randn(2, 4)
        out, want = g(x), ref(x)
        assert close(out, want), i
        assert torch.equal(g.hits, ref.hits), i
        out.sum().backward()
        want.sum().backward()
    assert close(g.lin.weight.grad, ref.lin.weight.grad)


class OutBuf(nn.Module):
    """Writes a plain tensor attribute and returns it (held tensor = output)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.buf = torch.zeros(2, 4)

    def forward(self, x):
        self.buf.copy_(self.lin(x))
        return self.buf


@pytest.mark.parametrize("warmups", [1, 2])
def test_held_tensor_returned_control(sim, warmups):
    torch.manual_seed(0)
    ref = OutBuf()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            got = g(x).clone()
            assert close(got, ref(x)), i
            assert close(g.buf, ref.buf), i


class AddInto(nn.Module):
    """Adds into its argument, which the caller passes as the module's own attribute too."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = torch.zeros(2, 4)

    def forward(self, x):
        x.add_(1)
        return self.lin(x) + self.acc


# (fixed after the review: an argument sharing a held tensor's memory runs eagerly)
@pytest.mark.parametrize("warmups", [1, 2])
def test_held_tensor_passed_as_input(sim, warmups):
    torch.manual_seed(0)
    ref = AddInto()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            got = g(g.acc).clone()
            want = ref(ref.acc)
            assert close(got, want), i
            assert torch.equal(g.acc, ref.acc), i


class WriteHeld(nn.Module):
    """Writes its own plain tensor attribute, and reads its argument (which may be that
    attribute, or a view of it). (Over 64 elements: a smaller CPU tensor is guarded by
    value, and every write would make the next call capture again.)"""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(40, 40)
        self.acc = torch.zeros(2, 40)

    def forward(self, x):
        self.acc.add_(1)
        return self.lin(x) * 2


@pytest.mark.parametrize("arg", ["whole", "row"])
def test_held_tensor_written_and_passed_after_capture(sim, arg):
    """Captured with an unrelated argument, then called (through the fast path) with the
    attribute the forward writes: the graph would read the argument's copy made before the
    write."""
    torch.manual_seed(0)
    ref = WriteHeld()
    g = cg.graphify(copy.deepcopy(ref))
    pick = (lambda m: m.acc) if arg == "whole" else (lambda m: m.acc[:1].expand(2, 40))
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 40)
            assert torch.equal(g(x), ref(x)), i
        replays = cg.stats(g).replays
        assert replays > 0
        for i in range(3):
            assert torch.equal(g(pick(g)), ref(pick(ref))), i
            assert torch.equal(g.acc, ref.acc), i
        assert cg.stats(g).replays == replays  # each ran eagerly
        x = torch.randn(2, 40)
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).replays == replays + 1  # and an unrelated argument replays again


class FailingHostBackend(SimBackend):
    """The first capture runs host work for real (it writes ``host``), then fails."""

    def __init__(self, host):
        super().__init__()
        self.host = host
        self.failed = False

    def capture(self, fn, device, pool=None, keep_graph=False):
        if self.failed:
            return super().capture(fn, device, pool, keep_graph)
        self.failed = True
        with torch.no_grad():
            for t in self.host:
                t.add_(100)
        raise CaptureFailed("boom")


def test_capture_failure_puts_held_back_control():
    torch.manual_seed(0)
    ref = BigHits()
    m = copy.deepcopy(ref)
    old = _capture.set_backend(FailingHostBackend([m.hits]))
    try:
        g = cg.graphify(m, num_warmup_iters=2)
        with torch.no_grad():
            for i in range(3):
                x = torch.randn(2, 4)
                assert close(g(x), ref(x)), i
                assert torch.equal(m.hits, ref.hits), (i, m.hits[:2], ref.hits[:2])
    finally:
        _capture.set_backend(old)


# -- share_graph refuses a forward that writes a held tensor (aa9f958, d1e3dc6) --------------


class FunctionalBN(nn.Module):
    """Batch norm with its running statistics as plain attributes (no buffer, no op the probe
    knows as a write)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rm = torch.zeros(4)
        self.rv = torch.ones(4)

    def forward(self, x):
        return F.batch_norm(self.lin(x), self.rm, self.rv, training=True, momentum=0.5)


@pytest.mark.xfail(strict=True, reason="documented (README, Limitations): share_graph's held-write refusal relies on "
                   "the probe: running statistics kept as plain attributes are not refused, and "
                   "the partner layer's eager warm-up updates the partner's twice (wrong values)")
def test_share_graph_functional_bn_partner_stats(reading):
    torch.manual_seed(0)
    layers = _distinct(nn.ModuleList([FunctionalBN() for _ in range(3)]))
    ref = copy.deepcopy(layers)
    _register(*layers)
    cg.share_graph(layers)
    with torch.no_grad():
        for step in range(2):
            x = torch.randn(2, 4)
            for k, (layer, twin) in enumerate(zip(layers, ref)):
                assert close(layer(x), twin(x)), (step, k)
                assert close(layer.rm, twin.rm), (step, k, layer.rm, twin.rm)


# (fixed after the review: the finding this test showed passes now)
def test_share_graph_held_counter_probe_off(reading):
    torch.manual_seed(0)
    layers = _distinct(nn.ModuleList([Hits() for _ in range(3)]))
    ref = copy.deepcopy(layers)
    _register(*layers)
    cg.share_graph(layers, probe=False)
    with torch.no_grad():
        for step in range(2):
            x = torch.randn(2, 4)
            for k, (layer, twin) in enumerate(zip(layers, ref)):
                assert close(layer(x), twin(x)), (step, k)
                assert torch.equal(layer.hits, twin.hits), (step, k, layer.hits, twin.hits)


def test_share_graph_held_counter_refused_control(reading):
    torch.manual_seed(0)
    layers = _distinct(nn.ModuleList([Hits() for _ in range(3)]))
    _register(*layers)
    group = cg.share_graph(layers)
    with torch.no_grad():
        layers[0](torch.randn(2, 4))
    reasons = " ".join(map(str, group.stats().reasons))
    assert "reads from outside" in reasons, reasons


# -- bucketed: four states per size, the training flag in the key (fad52b5) -----------------


class Late(nn.Module):
    """Centres over the batch from its fourth call on (a warm-up count kept as an int)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.n = 0

    def forward(self, x):
        self.n += 1
        if self.n > 3:
            x = x - x.mean(0, keepdim=True)
        return self.lin(x)


# (fixed after the review: the finding this test showed passes now)
def test_bucketed_state_changed_by_the_check_itself(sim):
    torch.manual_seed(0)
    m = Late().eval()
    ref = copy.deepcopy(m)
    b = cg.bucketed(m, [4])
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(3, 4)
            ref.n = m.n  # (the reference counts as the wrapped module does)
            assert close(b(x), ref(x)), (i, m.n)


def test_bucketed_refuses_a_forward_that_sets_attributes_and_runs_it_once(sim):
    """(Was: the guard sees the change the check's own runs made.) A forward that sets a
    module attribute on every call is refused by the check (its padded runs would set it
    again: helper-66's C), and the call ran it once."""
    torch.manual_seed(0)
    m = Late().eval()
    b = cg.bucketed(m, [4])
    with torch.no_grad():
        b(torch.randn(3, 4))
    assert m.n == 1 and not b.verified
    (why,) = b.refused.values()
    assert "Late's attributes" in why, why


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


def test_bucketed_submodule_alone_to_train_control(sim):
    """The root stays in eval (same key): the submodule's flag makes the state another one."""
    torch.manual_seed(0)
    ref = Norm().eval()
    g = cg.graphify(copy.deepcopy(ref))
    b = cg.bucketed(g, [4])
    with torch.no_grad():
        x = torch.randn(3, 4)
        assert close(b(x), ref(x))
        g.bn.train()
        ref.bn.train()
        for i in range(2):
            x = torch.randn(3, 4)
            assert close(b(x), ref(x)), i
            assert close(g.bn.running_mean, ref.bn.running_mean), i
    assert b.refused


def test_bucketed_function_target_control(sim):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    g = cg.graphify(lambda x: lin(x) * 2)
    b = cg.bucketed(g, [4])
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(3, 4)
            assert close(b(x), lin(x) * 2), i
    assert not b.refused
    assert all(key[-1] is None for key in b.verified)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.lin(x) * self.scale


def test_bucketed_five_states_refused_then_right_control(sim):
    torch.manual_seed(0)
    ref = Scaled().eval()
    g = cg.graphify(copy.deepcopy(ref))
    b = cg.bucketed(g, [4])
    with torch.no_grad():
        for scale in [1.0, 2.0, 3.0, 1.0, 4.0, 5.0, 2.0]:
            g.scale = ref.scale = scale
            x = torch.randn(3, 4)
            assert close(b(x), ref(x)), scale
    assert b.refused
