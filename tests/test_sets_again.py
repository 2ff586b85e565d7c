"""A forward that sets a module attribute to a constant (``self.used = True``, a per-signature
``self.last_n = x.shape[0]``) or to the object it held (``self.keep = self.value``, set again by
identity; review finding SL-P2): a replay runs no Python, so it sets those attributes again itself
(``_watch.set_again``), on every replay path: the engine's, the fast path, a training graph's, a
static-state family's rebased graph and a share_graph layer's graph made from its template. And
share_graph's own runs (the template's capture, its partner layer's runs) are no calls: what they
set on any layer is put back, and a forward that sets an attribute on every call (a counter) is
refused sharing as the engine refuses its graph.

CPU, simulated backend (``sim``), share_graph's graph-reading double (``reading``) and the
families' double (``fam``, test_rebase.py); every output compared with an eager deep-copied twin
(``torch.equal``), and the attributes too. The cases of helper-132's review are in
tests/test_review_wo.py."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _watch
from test_rebase import _cache, _register as _register_cache, fam  # noqa: F401 (a fixture)
from test_review_setobj import _Keeps  # (sets ``keep`` to the object ``value`` holds)
from test_review_static_state import _step
from test_share_engine import _register, reading  # noqa: F401 (a fixture)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _Flag(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.used = False

    def forward(self, x):
        self.used = True
        return self.lin(x)


class _Counts(nn.Module):
    """Sets an attribute to a new value on every call: no graph may stand for it."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.n = 0

    def forward(self, x):
        self.n = self.n + 1
        return self.lin(x)


class _ReadsFlag(nn.Module):
    """Reads another module's flag: its graph for one value must not serve the other."""

    def __init__(self, other: nn.Module):
        super().__init__()
        self.other = [other]  # (not a submodule: its own graphed callable)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * (2 if self.other[0].used else 3)


class _Nested(nn.Module):
    """The flag is set by a submodule's forward, inside the root's graph."""

    def __init__(self):
        super().__init__()
        self.inner = _Flag()
        self.mode = "off"

    def forward(self, x):
        self.mode = "on"
        return self.inner(x) + 1


def _twins(cls, *a, **kw):
    torch.manual_seed(0)
    m = cls(*a).eval()
    return m, cg.graphify(copy.deepcopy(m), **kw)


def _same(g, m, x):
    assert torch.equal(g(x), m(x))


# -- the engine's and the fast path's replays ----------------------------------------------------


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "engine"])
def test_a_reset_flag_is_set_again_by_every_replay(sim, fast, monkeypatch):
    if not fast:  # (the engine's own replay: a call the fast path declines)
        from cudagraphify import _fast
        monkeypatch.setattr(_fast.Fast, "make", staticmethod(lambda *a, **k: None))
    m, g = _twins(_Flag)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            _same(g, m, x)
        replays = cg.stats(g).replays
        for _ in range(4):
            g.used = m.used = False
            _same(g, m, x)
            assert g.used is True
    s = cg.stats(g)
    assert s.replays == replays + 4 and s.captures == 1, s


_VALUES = {"list": lambda: [1], "object": object, "tensor": lambda: torch.ones(2)}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "engine"])
@pytest.mark.parametrize("kind", list(_VALUES))
def test_an_object_reset_is_set_again_by_identity(sim, fast, kind, monkeypatch):
    if not fast:
        from cudagraphify import _fast
        monkeypatch.setattr(_fast.Fast, "make", staticmethod(lambda *a, **k: None))
    m, g = _twins(_Keeps, _VALUES[kind]())
    g.value = m.value  # (the same object in both: compared by identity)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            _same(g, m, x)
        replays = cg.stats(g).replays
        for _ in range(4):
            g.keep = m.keep = None
            _same(g, m, x)
            assert g.keep is g.value
        # the user puts another object there: the next call sets that one
        g.value = m.value = _VALUES[kind]()
        g.keep = m.keep = None
        _same(g, m, x)
        assert g.keep is g.value
        for _ in range(2):
            g.keep = None
            _same(g, m, x)
            assert g.keep is g.value
    s = cg.stats(g)
    assert s.replays >= replays + 6, s


def test_replays_that_find_the_object_in_place_move_no_epoch(sim):
    m, g = _twins(_Keeps, [1])
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            _same(g, m, x)
        before, replays = _watch.epoch, cg.stats(g).replays
        for _ in range(3):
            _same(g, m, x)
    assert _watch.epoch == before and cg.stats(g).replays == replays + 3


def test_nested_and_root_constants_are_set_again(sim):
    m, g = _twins(_Nested)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            _same(g, m, x)
        g.mode, g.inner.used = "off", False
        replays = cg.stats(g).replays
        _same(g, m, x)
        assert (g.mode, g.inner.used) == ("on", True)
        del g.mode  # (a deleted attribute is set again too, as the forward would)
        _same(g, m, x)
        assert g.mode == "on"
    assert cg.stats(g).replays == replays + 2


def test_each_signature_sets_its_own_value(sim):
    class PerSig(_Flag):
        def forward(self, x):
            self.last = (x.shape[0], "rows")
            return self.lin(x)

    m, g = _twins(PerSig)
    with torch.no_grad():
        for n in [3, 5, 3, 5, 3, 3, 5, 5]:
            _same(g, m, torch.randn(n, 8))
            assert g.last == m.last == (n, "rows")
    s = cg.stats(g)
    assert s.captures == 2 and s.replays >= 4, s


def test_a_replay_that_changes_a_flag_moves_the_epoch_for_other_guards(sim):
    """A graph that read the flag checks its guard again after another graph's replay set it:
    the replay's set is a module write, as the forward's was."""
    torch.manual_seed(0)
    a_ref = _Flag().eval()
    b_ref = _ReadsFlag(a_ref).eval()
    a = cg.graphify(copy.deepcopy(a_ref))
    b_twin = _ReadsFlag(a)
    b_twin.load_state_dict(b_ref.state_dict())
    b = cg.graphify(b_twin)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            _same(a, a_ref, x)
            _same(b, b_ref, x)
        a.used = a_ref.used = False
        for _ in range(3):
            _same(b, b_ref, x)  # (the other branch)
        _same(a, a_ref, x)  # a replay: sets it back to True
        assert a.used is True
        _same(b, b_ref, x)
    assert cg.stats(a).replays >= 3


def test_the_object_an_attribute_held_is_noted_and_a_new_equal_one_is_a_write():
    """``self.items = self.items`` (the very object) is noted as a set, to be made again by
    identity; an equal list made anew is a write (a replay could not hand out a new one)."""
    m = _Flag()
    rec = _watch.Recorder(everything=frozenset({id(m)}))
    items = [1]
    m.items, m.used = items, True
    _watch.install()
    with _watch.recording(rec, ran=False):
        m.items = items
        m.used = True
        m.other = [1]
        m.other = [1]
    assert [(n, v) for _, n, v in rec.sets] == [("items", items), ("used", True)]
    assert rec.sets[0][2] is items
    assert [n for _, n, _, _ in rec.writes] == ["other", "other"]


def test_set_again_skips_a_dead_module_and_bumps_only_on_a_change():
    import weakref

    m, gone = _Flag(), _Flag()
    sets = ((weakref.ref(m), "used", True), (weakref.ref(gone), "used", True))
    del gone
    gc.collect()
    m.used = True
    before = _watch.epoch
    _watch.set_again(sets)
    assert _watch.epoch == before
    m.__dict__["used"] = False
    _watch.set_again(sets)
    assert m.used is True and _watch.epoch != before


# -- training --------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["flag", "object"])
def test_a_training_replay_sets_the_attribute_again(sim, what):
    """``self.used = True`` (a constant) or ``self.keep = self.value`` (an object, set from
    that attribute), reset between training calls: each replay sets it again."""
    torch.manual_seed(0)
    m = _Flag().train() if what == "flag" else _Keeps([1]).train()
    g = cg.graphify(copy.deepcopy(m))
    name, value = ("used", True) if what == "flag" else ("keep", m.value)
    if what == "object":
        g.value = m.value
    x = torch.randn(3, 8)
    for _ in range(3):
        a, b = g(x), m(x)
        a.sum().backward(), b.sum().backward()
    replays = cg.stats(g).replays
    for _ in range(2):
        setattr(g, name, None)
        setattr(m, name, None)
        a, b = g(x), m(x)
        a.sum().backward(), b.sum().backward()
        assert torch.equal(a, b) and getattr(g, name) is value
    for p, q in zip(g.parameters(), m.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert cg.stats(g).replays == replays + 2


# -- a static-state family's rebased graphs --------------------------------------------------


class _CacheFlag(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        self.projs = nn.ModuleList([nn.Linear(16, 16) for _ in range(n)])
        self.stepped = False

    def forward(self, x, cache, pos):
        self.stepped = True
        for i, proj in enumerate(self.projs):
            keys = cache.layers[i].update(proj(x), pos)
            x = x + keys.mean(1, keepdim=True)
        return x


def test_a_rebased_graph_sets_the_flag_again(fam):  # noqa: F811
    torch.manual_seed(0)
    ref = _CacheFlag()
    g = cg.graphify(copy.deepcopy(ref))
    kept = []
    for _ in range(5):
        rc, c = _cache(), _cache()
        for t in range(3):
            g.stepped = ref.stepped = False
            _step(ref, g, rc, c, t)
            _register_cache(c)
            assert g.stepped is True
        kept.append((rc, c))
    s = cg.stats(g)
    assert s.retargets >= 2, (s.captures, s.retargets, s.eager_calls)


# -- share_graph ---------------------------------------------------------------------------------


def _layers(cls, n: int = 4):
    torch.manual_seed(0)
    layers = nn.ModuleList(cls() for _ in range(n))
    ref = copy.deepcopy(layers)
    _register(layers)
    return layers, ref, cg.share_graph(layers)


def test_share_graph_layers_set_their_own_flag_again(reading):  # noqa: F811
    layers, ref, group = _layers(_Flag)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            for m, r in zip(layers, ref):
                _same(m, r, x)
        for k in range(4):
            for j, (m, r) in enumerate(zip(layers, ref)):
                m.used = r.used = j != k  # one layer reset at a time
            for m, r in zip(layers, ref):
                _same(m, r, x)
            assert all(m.used is True for m in layers)
    s = group.stats()
    assert s.per_layer == 0 and s.retargets >= 3 and not s.reasons, s


def test_share_graph_refuses_a_counter_and_leaves_every_layers_count_as_eager(
        reading):  # noqa: F811
    layers, ref, group = _layers(_Counts)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(4):
            for m, r in zip(layers, ref):
                _same(m, r, x)
                # (the partner layer's runs, before its own call, leave its count too)
                assert [a.n for a in layers] == [b.n for b in ref]
    s = group.stats()
    assert s.retargets == 0 and any("sets _Counts.n on every call" in r for r in s.reasons), s


@pytest.mark.parametrize("one", [True, False], ids=["one_object", "own_objects"])
def test_share_graph_layers_set_their_own_object_again(reading, one):  # noqa: F811
    """A layer whose forward sets an object it holds (one list held by every layer, or a list
    of each layer's own) is refused sharing: each layer's own graph sets its own object again
    (a template's replay could not set another layer's)."""
    torch.manual_seed(0)
    items = [1]
    layers = nn.ModuleList(_Keeps(items if one else [1]) for _ in range(4))
    ref = copy.deepcopy(layers)
    _register(layers)
    group = cg.share_graph(layers)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for step in range(5):
            for m, r in zip(layers, ref):
                m.keep = r.keep = None
                _same(m, r, x)
                assert m.keep is m.value, step
    s = group.stats()
    assert sum(cg.stats(m).replays for m in layers) >= 12, s
    assert s.per_layer == 4 and s.retargets == 0, s
    # (the template layer's capture refuses it, or a later layer's call: it sets what the
    # template's replay would not)
    assert s.reasons and all("sets _Keeps.keep to an object of its own" in r
                             or "sets 'keep'" in r for r in s.reasons), s
