"""Review of 33f627b (weak proxies' class checks through the proxy, proxied modules in closure
cells and defaults, flat enum members keyed with no walk), f71c3d8 (``bucketed``'s
``_tensors_of`` through ``_state.tensors_in``; ``_HostReads``' sources found once), f725d52
(``_watch.tree_epoch``: ``bucketed`` walks its trees again only when a tree epoch moved), and of
the module-class guard, the patched ``nn.Module.__setattr__`` and enum/constant keys at large.

Findings (strict xfails at review, each failing because of the finding; all fixed since, plain
tests now; controls pass):

- G11-1 (stale, older): an enum member with attributes of its own (set in ``__init__`` or
  afterwards) held as a module attribute or in a graphed function's closure cell: the member
  is a constant, compared by identity (``_watch.same``'s ``a is b``, ``_cell_holds``) and not
  watched, so ``Mode.A.scale = 3.0`` after capture replays the old scale; ``bucketed`` pads
  a forward that now centers across rows. (As an argument it is keyed with its attributes:
  seen, a control.)
- G11-2 (stale, older; f725d52's ``loose`` does not cover it): ``bucketed`` over a module whose
  ``_modules`` registry is kept elsewhere too (``copy.copy`` of a ModuleList shares it): an
  ``append`` writes the kept plain dict, which moves neither epoch, so ``_State.same`` answers
  from the epochs and the new row-mixing layer is padded without a check. (graphify checks a
  kept registry's version per call: a control.)
- G11-3 (stale result where eager raises; new in 33f627b for modules, older for a proxied
  plain object): a ``weakref.proxy`` whose target dies after capture: ``_class_of`` answers
  None and the check passes (a dead proxy "is" unchanged), the closure cell still holds the
  same proxy, and the graph replays a result where eager raises ``ReferenceError``.
- G11-4 (stale, new in 33f627b): ``StateGuard._changed`` compares the tree's classes with
  ``_class_of(m) not in (cls, None)``, by ``==``: a module class whose metaclass compares by
  name (a registry's, or one surviving reloads) swapped for a redefined class of the same
  name is taken as unchanged (before: ``type(m) is not cls``, by identity).
- G11-5 (stale, older): a method replaced on a module instance (``m.helper = f``, through
  ``nn.Module.__setattr__``): the recorder notes no read of a name found on the class as a
  callable, so the epoch move finds nothing changed (or, for a module only found in a
  container, no epoch moves at all): the graph replays the class's method.
- G11-6 (cost, new in f71c3d8): ``_tensors_of`` through ``tensors_in`` keeps no visited set:
  objects sharing references (nodes that each hold the list of all nodes) are walked once
  per path, N**3 at depth 4: a bucket's first call with a host read of data took 679 ms at
  150 nodes against 3 ms before (45 ms against 6 ms at 50).

Not findings (measured): f725d52 and the later ``_globals_same`` add about 0.15 us to
``_State.same()`` per padded call without module writes (0.06 -> 0.22 us, this CPU), within
the noise of a ~60 us padded call.

Graphify runs through the simulated backend (conftest.py).
"""

from __future__ import annotations

import copy
import enum
import gc
import types
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _bucket, _state

from test_review_guard8 import Doubler, Tripler, WithPost
from test_review_guard10 import ProxyHolder, RefHolder

pytestmark = pytest.mark.usefixtures("quiet")


def _outputs(g, change=None, at=3, n=5):
    """``g(ones(2))[0]`` over ``n`` calls, ``change()`` before call ``at``; a ReferenceError
    is an output too (what eager gives for a dead proxy)."""
    outs = []
    with torch.no_grad():
        for i in range(n):
            if i == at and change is not None:
                change()
            try:
                outs.append(g(torch.ones(2))[0].item())
            except ReferenceError:
                outs.append("ReferenceError")
    return outs


SWAPPED = [2.0, 2.0, 2.0, 3.0, 3.0]


# -- G11-1: an enum member's own attribute, the member held by identity ------------------------

class Mode(enum.Enum):
    A = 1

    def __init__(self, v):
        self.scale = 2.0  # (an attribute of the member: flat, keyed with no walk)
        self.center = False


@pytest.fixture
def mode_reset():
    yield
    Mode.A.scale, Mode.A.center = 2.0, False


class HoldsMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.mode = Mode.A

    def forward(self, x):
        return x * self.mode.scale


def _closure_of_member():
    mode = Mode.A

    def f(x):
        return x * mode.scale
    return f


MEMBER_HELD = {
    "a module attribute": lambda: cg.graphify(HoldsMode()),
    "a graphed function's closure cell": lambda: cg.graphify(_closure_of_member()),
    "a kept function's closure cell": lambda: cg.graphify(WithPost(_closure_of_member())),
}


@pytest.mark.parametrize("where", list(MEMBER_HELD))
def test_g11_1_a_held_members_attribute_set_anew_is_seen(sim, mode_reset, where):
    g = MEMBER_HELD[where]()
    assert _outputs(g, lambda: setattr(Mode.A, "scale", 3.0)) == SWAPPED


class CentersOnFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.mode = Mode.A

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if self.mode.center else x * 2


def _bucketed_rows(m, change):
    b = cg.bucketed(m, [4, 8])
    with torch.no_grad():
        for i in range(4):
            if i == 2:
                change()
            x = torch.randn(3, 2)
            got = b(x)
            with torch.no_grad():
                want = m(x)
            assert torch.allclose(got, want, atol=1e-6), f"call {i}: padded rows interacted"
    return b


def test_g11_1_bucketed_a_held_members_attribute_set_anew_is_checked(sim, mode_reset):
    _bucketed_rows(CentersOnFlag(), lambda: setattr(Mode.A, "center", True))


class TimesMode(nn.Module):
    def forward(self, x, mode):
        return x * mode.scale


def test_g11_1_control_a_members_attribute_as_an_argument_is_seen(sim, mode_reset):
    g = cg.graphify(TimesMode())
    outs = []
    with torch.no_grad():
        for i in range(5):
            if i == 3:
                Mode.A.scale = 3.0
            outs.append(g(torch.ones(2), Mode.A)[0].item())
    assert outs == SWAPPED
    assert cg.stats(g).replays >= 2


def test_g11_1_control_a_held_member_replays(sim, mode_reset):
    g = cg.graphify(HoldsMode())
    assert _outputs(g) == [2.0] * 5
    assert cg.stats(g).replays == 4


# -- G11-2: bucketed over a registry kept elsewhere --------------------------------------------

class Rowwise(nn.Module):
    def forward(self, h):
        return h * 2


class Center(nn.Module):  # (computes across the batch: padded rows change the real ones)
    def forward(self, h):
        return h - h.mean(0, keepdim=True)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Rowwise()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_g11_2_bucketed_append_to_a_kept_registry_is_checked(sim):
    m = Stack()
    twin = copy.copy(m.layers)  # (shares layers' _modules: kept elsewhere, left a plain dict)
    _bucketed_rows(m, lambda: m.layers.append(Center()))
    assert twin is not None


def test_g11_2_control_bucketed_append_to_a_watched_registry_is_checked(sim):
    m = Stack()
    b = _bucketed_rows(m, lambda: m.layers.append(Center()))
    assert b.refused  # (the new tree failed its check: unpadded)


def test_g11_2_control_graphify_sees_an_append_to_a_kept_registry(sim):
    m = Stack()
    twin = copy.copy(m.layers)
    g = cg.graphify(m)
    assert _outputs(g, lambda: m.layers.append(Rowwise())) == [2.0, 2.0, 2.0, 4.0, 4.0]
    assert twin is not None


# -- G11-3: a weak proxy whose target died -----------------------------------------------------

class Cfg:
    def __init__(self):
        self.scale = 2.0


def _module_proxy_cell():
    d = Doubler()
    p = weakref.proxy(d)

    def post(x):
        return p.apply_to(x)
    return cg.graphify(WithPost(post)), [d]


def _module_proxy_holder():
    d = Doubler()
    return cg.graphify(WithPost(ProxyHolder(d).run)), [d]


def _object_proxy_cell():
    c = Cfg()
    p = weakref.proxy(c)

    def post(x):
        return x * p.scale
    return cg.graphify(WithPost(post)), [c]


DYING = {
    "a module's proxy in a closure cell (new)": _module_proxy_cell,
    "a module's proxy in a kept object (new)": _module_proxy_holder,
    "a plain object's proxy in a closure cell (older)": _object_proxy_cell,
}


@pytest.mark.parametrize("where", list(DYING))
def test_g11_3_a_dead_proxys_graph_raises_as_eager(sim, where):
    g, alive = DYING[where]()

    refs = [weakref.ref(o) for o in alive]

    def kill():
        alive.clear()
        gc.collect()
        if any(r() is not None for r in refs):
            raise RuntimeError("the proxy's target is still alive: no test")
    assert _outputs(g, kill) == [2.0, 2.0, 2.0, "ReferenceError", "ReferenceError"]


def test_g11_3_control_a_live_proxys_graph_replays(sim):
    g, alive = _module_proxy_cell()
    assert _outputs(g) == [2.0] * 5
    assert cg.stats(g).replays == 4


def test_g11_3_control_a_weakref_target_is_held_alive_and_consistent(sim):
    d = Doubler()
    g = cg.graphify(WithPost(RefHolder(d).run))
    w = weakref.ref(d)

    def drop():
        nonlocal d
        del d
        gc.collect()
    assert _outputs(g, drop) == [2.0] * 5  # (the guard holds the target: eager sees it too)
    assert w() is not None


# -- G11-4: the tree's classes compared by == ----------------------------------------------------

class ByName(type):
    """A metaclass whose classes compare by name (a registry's, or one surviving reloads)."""

    def __eq__(cls, other):
        return isinstance(other, ByName) and cls.__qualname__ == other.__qualname__

    def __hash__(cls):
        return hash(cls.__qualname__)


def _helper_class(k):
    class Helper(nn.Module, metaclass=ByName):
        def apply_to(self, h):
            return h * k
    return Helper


class UsesHelper(nn.Module):
    def __init__(self, helper):
        super().__init__()
        self.d = helper

    def forward(self, x):
        return self.d.apply_to(x)  # (a method of a submodule: the module is not called)


def test_g11_4_a_swap_to_an_equal_comparing_class_is_seen(sim):
    old, new = _helper_class(2), _helper_class(3)
    assert old == new and old is not new
    m = UsesHelper(old())
    assert _outputs(cg.graphify(m), lambda: setattr(m.d, "__class__", new)) == SWAPPED


def test_g11_4_control_a_swap_to_another_class_is_seen(sim):
    m = UsesHelper(Doubler())
    assert _outputs(cg.graphify(m), lambda: setattr(m.d, "__class__", Tripler)) == SWAPPED


# -- G11-5: a method replaced on a module instance -----------------------------------------------

class Root(nn.Module):
    def helper(self, x):
        return x * 2

    def forward(self, x):
        return self.helper(x)


class InList(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.items = [d]

    def forward(self, x):
        return self.items[0].apply_to(x)


def _root():
    m = Root()
    return cg.graphify(m), lambda: setattr(m, "helper", lambda x: x * 3)


def _submodule():
    m = UsesHelper(Doubler())
    return cg.graphify(m), lambda: setattr(m.d, "apply_to", lambda x: x * 3)


def _listed():
    d = Doubler()
    return cg.graphify(InList(d)), lambda: setattr(d, "apply_to", lambda x: x * 3)


REPLACED = {"the root's method": _root, "a submodule's method": _submodule,
            "a listed module's method": _listed}


@pytest.mark.parametrize("where", list(REPLACED))
def test_g11_5_a_method_replaced_on_the_instance_is_seen(sim, where):
    g, replace = REPLACED[where]()
    assert _outputs(g, replace) == SWAPPED


def test_g11_5_control_a_plain_attribute_replaced_is_seen(sim):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = 2.0

        def forward(self, x):
            return x * self.k
    m = Scaled()
    assert _outputs(cg.graphify(m), lambda: setattr(m, "k", 3.0)) == SWAPPED


def test_g11_5_control_forward_replaced_on_the_instance_is_seen(sim):
    m = Root()
    g = cg.graphify(m)
    assert _outputs(g, lambda: setattr(m, "forward", lambda x: x * 3)) == SWAPPED


# -- G11-6: _tensors_of walks shared references once per path ------------------------------------

class Node:
    def __init__(self, nodes):
        self.all = nodes  # (each node holds the list of all nodes)
        self.w = torch.zeros(1)


def _walks(monkeypatch, n):
    calls = [0]
    real = _state.tensors_in

    def counting(value, depth=0, seen=None):
        calls[0] += 1
        return real(value, depth, seen)
    monkeypatch.setattr(_state, "tensors_in", counting)  # (its own recursion looks it up)
    monkeypatch.setattr(_bucket, "tensors_in", counting)
    m = nn.Module()
    nodes: list = []
    nodes.extend(Node(nodes) for _ in range(n))
    m.nodes = nodes
    found = _bucket._tensors_of(m)
    return calls[0], found


def test_g11_6_tensors_of_walks_shared_objects_once(monkeypatch):
    calls, found = _walks(monkeypatch, 40)
    assert calls <= 10 * 40, f"{calls} walks for 40 nodes"


def test_g11_6_control_tensors_of_finds_every_kept_tensor(monkeypatch):
    calls, found = _walks(monkeypatch, 5)
    ids = {id(t) for t in found}
    assert len(ids) == 5


# -- controls of 33f627b -------------------------------------------------------------------------

def test_control_a_proxied_modules_class_swap_in_a_cell_is_seen(sim):
    g, alive = _module_proxy_cell()
    d = alive[0]
    assert _outputs(g, lambda: setattr(d, "__class__", Tripler)) == SWAPPED


class Planet(enum.Enum):
    SLOW = 1

    def __init__(self, v):
        self.speed = 0.0


def test_control_flat_member_keys_tell_floats_apart(mode_reset):
    from cudagraphify._signature import is_constant, strict_key
    assert is_constant(Planet.SLOW)
    before = strict_key(Planet.SLOW)
    try:
        Planet.SLOW.speed = -0.0
        assert strict_key(Planet.SLOW) != before
    finally:
        Planet.SLOW.speed = 0.0
    assert strict_key(Planet.SLOW) == before
