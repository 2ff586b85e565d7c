"""A forward that sets a module attribute to a constant (a write-only flag ``self.used = True``,
a per-signature ``self.last_n = x.shape[0]``): a replay runs no Python, so it sets those again
itself (``_watch.set_again``; tests/test_sets_again.py). helper-132's review of an earlier fix
(6d76db4, reverted: it guarded such a set as a read, and captured on every call where the value
changes per signature or is reset per call, and made share_graph refuse layers), adapted: once
strict xfails, now plain tests. CPU, simulated backend (``sim``) and share_graph's graph-reading
double (``reading``); every output compared with an eager deep-copied twin, and the user-visible
attribute too."""


from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
import test_share_engine as tse  # noqa: F401
from test_share_engine import _register, _unseen, reading  # noqa: F401 (fixtures)

class _Flag(nn.Module):
    def __init__(self, d: int = 4):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.used = False

    def forward(self, x):
        self.used = True
        return self.lin(x)


class _PerSig(nn.Module):
    """Sets an attribute to a constant that differs per signature (the last batch size)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.last_n = 0

    def forward(self, x):
        self.last_n = x.shape[0]
        return self.lin(x)


class _RootSets(nn.Module):
    """The root's own code (run eagerly: a host sync) sets a flag; its child is a piece."""

    def __init__(self):
        super().__init__()
        self.inner = _Flag()
        self.used = False

    def forward(self, x):
        self.used = True
        h = x * 1 if x.sum().item() > -1e9 else x
        return self.inner(h) + 1


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _same(g, m, x):
    got, want = g(x), m(x)
    assert torch.equal(got, want)


# -- findings ------------------------------------------------------------------------------


def _shared_layers():
    torch.manual_seed(0)
    layers = nn.ModuleList(_Flag(8) for _ in range(4))
    ref = copy.deepcopy(layers)
    _register(layers)
    return layers, ref, cg.share_graph(layers)


def test_share_graph_layers_set_the_flag_again_after_a_reset(reading, quiet):  # noqa: F811
    layers, ref, group = _shared_layers()
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            for m, r in zip(layers, ref):
                _same(m, r, x)
        for m, r in zip(layers, ref):
            m.used = r.used = False
        for m, r in zip(layers, ref):
            _same(m, r, x)
    assert [m.used for m in layers] == [r.used for r in ref] == [True] * 4


def test_share_graph_shares_every_layer_of_a_flag_setting_block(reading, quiet):  # noqa: F811
    layers, ref, group = _shared_layers()
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            for m, r in zip(layers, ref):
                _same(m, r, x)
    s = group.stats()
    assert s.per_layer == 0 and not s.reasons, s.reasons


def test_a_per_signature_constant_keeps_replaying(sim, quiet):
    torch.manual_seed(0)
    m = _PerSig().eval()
    g = cg.graphify(copy.deepcopy(m))
    xs = [torch.randn(3, 4), torch.randn(5, 4)]
    with torch.no_grad():
        for i in range(20):
            _same(g, m, xs[i % 2])
            assert g.last_n == m.last_n
    s = cg.stats(g)
    assert s.captures <= 4 and s.replays >= 10, (s.captures, s.replays)


def test_a_flag_reset_before_every_call_does_not_capture_every_call(sim, quiet):
    torch.manual_seed(0)
    m = _Flag().eval()
    g = cg.graphify(copy.deepcopy(m))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(20):
            g.used = m.used = False
            _same(g, m, x)
            assert g.used is m.used is True
    s = cg.stats(g)
    assert s.captures <= 3, (s.captures, s.replays, dict(s.eager_calls))


# -- further cases ------------------------------------------------------------------------------


def test_per_signature_constant_values_are_right(sim, quiet):
    torch.manual_seed(0)
    m = _PerSig().eval()
    g = cg.graphify(copy.deepcopy(m))
    with torch.no_grad():
        for n in [3, 5, 3, 3, 5, 5, 3]:
            _same(g, m, torch.randn(n, 4))
            assert g.last_n == m.last_n


def test_capture_sizes_flag_reset(sim, quiet):
    torch.manual_seed(0)
    m = _Flag().eval()
    g = cg.graphify(copy.deepcopy(m))
    with torch.no_grad():
        cg.capture_sizes(g, lambda n: (torch.randn(n, 4),), [8, 4, 2], progress=False)
        for n in (8, 4, 2):
            m(torch.randn(n, 4))
        for n in [2, 4, 8, 4]:
            _same(g, m, torch.randn(n, 4))
        g.used = m.used = False
        _same(g, m, torch.randn(4, 4))
        assert g.used is True
    assert cg.stats(g).captures == 3  # (a reset is no read: no new capture)


def test_bucketed_flag_reset(sim, quiet):
    torch.manual_seed(0)
    m = _Flag().eval()
    g = cg.graphify(copy.deepcopy(m))
    b = cg.bucketed(g, [2, 4, 8])
    with torch.no_grad():
        for n in [3, 1, 5, 8, 2, 7]:
            x = torch.randn(n, 4)
            torch.testing.assert_close(b(x), m(x))
        g.used = m.used = False
        x = torch.randn(3, 4)
        torch.testing.assert_close(b(x), m(x))
        assert g.used is True


def test_training_flag_reset(sim, quiet):
    torch.manual_seed(0)
    m = _Flag().train()
    g = cg.graphify(copy.deepcopy(m))
    x = torch.randn(3, 4)
    for _ in range(5):
        a, b = g(x), m(x)
        a.sum().backward(), b.sum().backward()
        assert torch.equal(a, b)
    g.used = m.used = False
    _same(g, m, x)
    assert g.used is True
    for p, q in zip(g.parameters(), m.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_segments_members_flag_reset(sim, segments_enabled, quiet):
    torch.manual_seed(0)
    m = _RootSets().eval()
    g = cg.graphify(copy.deepcopy(m))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(6):
            _same(g, m, x)
        for mod in (g, g.inner, m, m.inner):
            mod.used = False
        _same(g, m, x)
        assert g.used is g.inner.used is True


def test_explain_leaves_the_flag(sim, quiet):
    m = _Flag().eval()
    cg.explain(m, torch.randn(2, 4))
    assert m.used is False
