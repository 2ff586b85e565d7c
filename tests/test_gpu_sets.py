"""GPU: a module attribute the forward sets to a constant (or to the object it held, by
identity) is set again by every replay (a flag the user resets, a per-signature value), on the
fast path, the engine's, a training graph's and a share_graph layer's; a counter is refused
sharing and counts as eager. Outputs bitwise equal to an eager deep-copied twin, the attributes
equal, replay counters asserted (tests/test_sets_again.py is the CPU version)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]


class _Flag(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.used = False

    def forward(self, x):
        self.used = True
        self.last = x.shape[0]
        return self.norm(torch.relu(self.lin(x)))


class _Counts(_Flag):
    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, x):
        self.n = self.n + 1
        return super().forward(x)


def _twins(cls, train=False):
    torch.manual_seed(0)
    m = cls().cuda().train(train)
    return m, cg.graphify(copy.deepcopy(m))


def test_inference_replays_set_the_flag_and_the_per_signature_value():
    m, g = _twins(_Flag)
    xs = {n: torch.randn(n, 64, device="cuda") for n in (4, 8)}
    with torch.no_grad():
        for n in (4, 8, 4, 8):
            assert torch.equal(g(xs[n]), m(xs[n]))
        replays = cg.stats(g).replays
        for n in (4, 4, 8, 8, 4):
            g.used = m.used = False
            assert torch.equal(g(xs[n]), m(xs[n]))
            assert g.used is True and g.last == m.last == n
    assert cg.stats(g).replays == replays + 5 and cg.stats(g).captures == 2


class _Keeps(_Flag):
    def __init__(self):
        super().__init__()
        self.value = [1]
        self.keep = None

    def forward(self, x):
        self.keep = self.value  # (the object it holds: set again by identity)
        return super().forward(x)


def test_inference_replays_set_the_object_again_by_identity():
    m, g = _twins(_Keeps)
    g.value = m.value
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(g(x), m(x))
        replays = cg.stats(g).replays
        for step in range(4):
            g.keep = None
            if step == 2:  # (another object: the next call sets that one)
                g.value = m.value = [2]
            assert torch.equal(g(x), m(x))
            assert g.keep is g.value is m.keep
    assert cg.stats(g).replays >= replays + 3


def test_training_replays_set_the_flag():
    m, g = _twins(_Flag, train=True)
    x = torch.randn(8, 64, device="cuda")
    for _ in range(3):
        a, b = g(x), m(x)
        a.sum().backward(), b.sum().backward()
        assert torch.equal(a, b)
    replays = cg.stats(g).replays
    g.used = m.used = False
    a, b = g(x), m(x)
    a.sum().backward(), b.sum().backward()
    assert torch.equal(a, b) and g.used is True
    assert cg.stats(g).replays == replays + 1
    for p, q in zip(g.parameters(), m.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_share_graph_layers_set_their_flag_and_a_counter_is_refused():
    for cls in (_Flag, _Counts):
        torch.manual_seed(0)
        layers = nn.ModuleList(cls() for _ in range(4)).cuda()
        ref = copy.deepcopy(layers)
        group = cg.share_graph(layers)
        x = torch.randn(8, 64, device="cuda")
        with torch.no_grad():
            for step in range(4):
                if step == 3:
                    for m, r in zip(layers, ref):
                        m.used = r.used = False
                for m, r in zip(layers, ref):
                    assert torch.equal(m(x), r(x))
                assert [m.used for m in layers] == [True] * 4
                if cls is _Counts:
                    assert [m.n for m in layers] == [r.n for r in ref]
        s = group.stats()
        if cls is _Flag:
            assert s.per_layer == 0 and s.retargets >= 3 and not s.reasons, s
            assert sum(cg.stats(m).replays for m in layers) >= 8
        else:
            assert s.retargets == 0 and any("sets _Counts.n" in r for r in s.reasons), s
