"""Review of ebc1523 (``_ClassCheck``s for a kept bound method's module ``self``, for modules
among a kept object's attributes and a function's positional defaults; the tree's classes
compared on every epoch move; a thread-local set of the enum members being walked in place of
``_constant_member``/``_member_key``'s ``path``).

Findings (strict xfails, each failing at review because of the finding; controls pass). All
are fixed since (plain tests now); G10-4's tests pass because their members' attributes are
flat (keyed with no walk): a re-entrant walk of a member with a container attribute, from user
code run during the walk, is still answered by identity (low, left):

- G10-1 (crash, new): a ``weakref.proxy`` of a module kept by a plain object whose bound method
  a module keeps (``self.d = weakref.proxy(d)``), or a bound method whose ``self`` is such a
  proxy: ``isinstance(proxy, nn.Module)`` is True, ``_ClassCheck`` takes ``weakref.ref`` of
  the proxy: TypeError at the first call (before: ran). The same for a graphed callable
  object's attribute (older: 09326f2's ``_ClassCheck`` for ``StateGuard``'s bindings).
- G10-2 (stale, older: G8-1/G9-2's fix incomplete): a module behind a ``weakref.proxy`` in a
  kept function's closure cell or positional default: ``_watch_callable``'s proxy branch adds
  nothing for a module's proxy; its class swapped replays the stale graph.
- G10-3 (per-call cost, new): an enum member with attributes of its own (``HTTPStatus.OK``, an
  enum whose ``__init__`` sets ``self.scale``) as an argument: the fast path's ``strict_key``
  on every call (``_fast.py``'s check against the kept key) now enters a generator context
  manager and a thread-local look-up (``strict_key`` about +1 us (2.0 to 3.0), ``is_constant``
  about +1.7 us, on CPU here, per such argument; no member or container among its attributes,
  no cycle possible).
- G10-4 (low, new): the visiting set is thread-global state, where ``path`` was an argument: a
  re-entrant ``is_constant``/``strict_key`` of a member whose walk is in progress on the same
  thread (code run by the walk: a ``__getattribute__``) takes it as "met again": True for a
  member holding a list, its key without its attributes.

Not findings (controls): the set is emptied when a walk raises; a member met again through a
container, a member with a non-constant attribute met first through another member, an
unrelated member walked meanwhile, another thread's walk; a bound method of the graphed root
kept on it (swap seen, root freed); no ``_changed`` on a call with no write. The tree's classes
compared on every epoch move cost about +28 us per move at 601 modules (about +18% where all
ran): the commit's stated trade, not a finding.

Graphify runs through the simulated backend (conftest.py).
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import threading
import types
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _guards, _signature

from test_review_guard8 import Doubler, Tripler, WithPost

pytestmark = pytest.mark.usefixtures("quiet")


def _outputs(g, change=None, at=3, n=5):
    outs = []
    try:
        with torch.no_grad():
            for i in range(n):
                if i == at and change is not None:
                    change()
                outs.append(g(torch.ones(2))[0].item())
    except TypeError as e:  # (G10-1: the guard's construction raises)
        raise AssertionError(f"TypeError: {e}") from None
    return outs


SWAPPED = [2.0, 2.0, 2.0, 3.0, 3.0]


# -- G10-1: a weak proxy of a module given to _ClassCheck -------------------------------------

class ProxyHolder:  # (a plain object keeping a module through a weak proxy)
    def __init__(self, d):
        self.d = weakref.proxy(d)

    def run(self, x):
        return self.d.apply_to(x)


class CallsProxy:  # (a graphed callable object, alike)
    def __init__(self, d):
        self.d = weakref.proxy(d)

    def __call__(self, x):
        return self.d.apply_to(x)


PROXIES = {
    "a kept object's attribute (new)": lambda d: cg.graphify(WithPost(ProxyHolder(d).run)),
    "a kept bound method's self (new)":
        lambda d: cg.graphify(WithPost(types.MethodType(Doubler.run, weakref.proxy(d)))),
    "a graphed callable object's attribute (older)": lambda d: cg.graphify(CallsProxy(d)),
}


@pytest.mark.parametrize("where", list(PROXIES))
def test_g10_1_a_weak_proxy_of_a_module_runs(sim, where):
    d = Doubler()
    assert _outputs(PROXIES[where](d)) == [2.0] * 5


def test_g10_1_a_weak_proxy_of_a_module_class_swap_is_seen(sim):
    d = Doubler()
    assert _outputs(PROXIES["a kept object's attribute (new)"](d),
                    lambda: setattr(d, "__class__", Tripler)) == SWAPPED


class RefHolder:
    """Holds a module by a weak reference and runs a method of it."""

    def __init__(self, d):
        self.d = weakref.ref(d)

    def run(self, x):
        return self.d().apply_to(x)


def test_g10_1_control_a_weak_ref_of_a_module_as_an_attribute_runs(sim):
    d = Doubler()
    g = cg.graphify(WithPost(RefHolder(d).run))
    assert _outputs(g, lambda: setattr(d, "__class__", Tripler)) == SWAPPED


# -- G10-2: a module behind a weak proxy in a closure cell or a positional default ------------

def _proxy_cell(d):
    p = weakref.proxy(d)

    def post(x):
        return p.apply_to(x)
    return post


def _proxy_default(d):
    def post(x, d=weakref.proxy(d)):
        return d.apply_to(x)
    return post


@pytest.mark.parametrize("make", [_proxy_cell, _proxy_default], ids=["cell", "default"])
def test_g10_2_a_proxied_modules_class_swap_is_seen(sim, make):
    d = Doubler()
    g = cg.graphify(WithPost(make(d)))
    assert _outputs(g, lambda: setattr(d, "__class__", Tripler)) == SWAPPED


def test_g10_2_control_the_module_itself_in_a_cell_or_default(sim):
    for make in (lambda d: (lambda x: d.apply_to(x)),
                 lambda d: (lambda x, d=d: d.apply_to(x))):
        d = Doubler()
        g = cg.graphify(WithPost(make(d)))
        assert _outputs(g, lambda: setattr(d, "__class__", Tripler)) == SWAPPED


# -- G10-3: per-call cost of the visiting set ---------------------------------------------------

class Act(enum.Enum):
    GELU = 1
    RELU = 2

    def __init__(self, _v):
        self.scale = 1.0 if _v == 1 else 0.5


def _visits_per_steady_call(monkeypatch):
    count = [0]
    real = getattr(_signature, "_visiting_member", None)  # (none before ebc1523)

    def counting(member):
        count[0] += 1
        return real(member)
    monkeypatch.setattr(_signature, "_visiting_member", counting, raising=False)

    def f(x, act):
        return x * act.scale
    g = cg.graphify(f)
    with torch.no_grad():
        for _ in range(3):
            g(torch.ones(2), Act.GELU)
        count[0] = 0
        outs = [g(torch.ones(2), Act.GELU)[0].item() for _ in range(5)]
    return count[0], outs


def test_g10_3_a_member_with_plain_attributes_walks_no_visiting_set(sim, monkeypatch):
    visits, outs = _visits_per_steady_call(monkeypatch)
    assert outs == [1.0] * 5
    assert visits == 0, f"{visits} visiting-set entries over 5 steady calls"


def test_g10_3_control_no_changed_on_calls_without_writes(sim, monkeypatch):
    calls = [0]
    real = _guards.StateGuard._changed

    def counting(self):
        calls[0] += 1
        return real(self)
    monkeypatch.setattr(_guards.StateGuard, "_changed", counting)
    m = WithPost(Doubler().run)
    g = cg.graphify(m)
    with torch.no_grad():
        for _ in range(3):
            g(torch.ones(2))
        calls[0] = 0
        for _ in range(5):
            g(torch.ones(2))
    assert calls[0] == 0


# -- G10-4 and controls: the thread-local visiting set --------------------------------------

class Dir(enum.Enum):
    UP = 1
    DOWN = 2
    LEFT = 3


@pytest.fixture
def clean_dirs():
    yield
    for member in Dir:
        for k in list(vars(member)):
            if k not in _signature.MEMBER_ATTRS:
                del member.__dict__[k]
    visiting = getattr(_signature, "_visiting", None)  # (none before ebc1523)
    assert not getattr(visiting, "ids", set())


@dataclasses.dataclass(frozen=True)
class Hook:
    """A frozen dataclass whose attribute reads run ``action`` once (code the walk runs)."""

    n: int = 0

    def __getattribute__(self, name):
        action = _HOOK.pop("action", None)
        if action is not None:
            _HOOK["result"] = action()
        return object.__getattribute__(self, name)


_HOOK: dict = {}


def test_g10_4_reentrant_is_constant_of_a_member_being_walked(clean_dirs):
    Dir.UP.hook, Dir.UP.bad = Hook(), [1]  # (the hook first: the walk stops at the list)
    assert not _signature.is_constant(Dir.UP)  # (outside any walk)
    _HOOK["action"] = lambda: _signature.is_constant(Dir.UP)
    _signature.is_constant(Dir.UP)
    assert _HOOK.pop("result") is False


def test_g10_4_reentrant_strict_key_of_a_member_being_walked(clean_dirs):
    Dir.UP.scale, Dir.UP.hook = 2.0, Hook()
    full = _signature.strict_key(Dir.UP)
    _HOOK["action"] = lambda: _signature.strict_key(Dir.UP)
    _signature.strict_key(Dir.UP)
    assert _HOOK.pop("result") == full


def test_g10_4_control_reentrant_walk_of_an_unrelated_member(clean_dirs):
    Dir.UP.hook, Dir.DOWN.bad = Hook(), [1]
    _HOOK["action"] = lambda: _signature.is_constant(Dir.DOWN)
    _signature.is_constant(Dir.UP)
    assert _HOOK.pop("result") is False


def test_g10_4_control_another_threads_walk_is_its_own(clean_dirs):
    Dir.UP.hook, Dir.UP.bad = Hook(), [1]  # (the hook first: the walk stops at the list)
    got = []

    def other_thread():
        t = threading.Thread(target=lambda: got.append(_signature.is_constant(Dir.UP)))
        t.start()
        t.join()
    _HOOK["action"] = other_thread
    _signature.is_constant(Dir.UP)
    assert got == [False]


def test_g10_control_the_set_is_emptied_when_a_walk_raises(clean_dirs):
    class Boom:
        @property
        def __dict__(self):
            raise KeyboardInterrupt  # (object_dict catches Exception, not this)
    Dir.UP.others = (Dir.DOWN,)
    Dir.DOWN.cfg = Boom()
    for fn in (_signature.is_constant, _signature.strict_key):
        try:
            fn(Dir.UP)
        except KeyboardInterrupt:
            pass
        assert not _signature._visiting.ids


@pytest.mark.parametrize("cycle", [False, True])
def test_g10_control_a_non_constant_member_met_first_through_another(clean_dirs, cycle):
    Dir.UP.others = (Dir.DOWN,)
    if cycle:
        Dir.DOWN.others = (Dir.UP,)
    Dir.DOWN.bad = [1]
    assert not _signature.is_constant(Dir.UP)
    assert not _signature.is_constant(Dir.DOWN)
    Dir.DOWN.bad = (1,)
    assert _signature.is_constant(Dir.UP) and _signature.is_constant(Dir.DOWN)


def test_g10_control_a_member_met_twice_off_a_cycle_is_keyed_both_times(clean_dirs):
    Dir.UP.pair = (Dir.DOWN, Dir.DOWN)
    Dir.UP.other = Dir.DOWN
    Dir.DOWN.cfg = 2.0
    k = _signature.strict_key(Dir.UP)
    Dir.DOWN.cfg = 3.0
    assert _signature.strict_key(Dir.UP) != k
    Dir.DOWN.cfg = 2.0
    assert _signature.strict_key(Dir.UP) == k


def test_g10_control_a_three_member_cycle_keys_every_attribute(clean_dirs):
    Dir.UP.nxt, Dir.DOWN.nxt, Dir.LEFT.nxt = (Dir.DOWN,), (Dir.LEFT,), (Dir.UP,)
    Dir.LEFT.cfg = 1.0
    k = _signature.strict_key(Dir.UP)
    assert _signature.is_constant(Dir.UP)
    Dir.LEFT.cfg = -1.0
    assert _signature.strict_key(Dir.UP) != k
    Dir.LEFT.cfg = [1.0]
    assert not _signature.is_constant(Dir.DOWN)


# -- controls: the bound method's module self -------------------------------------------------

class Root(Doubler):
    def __init__(self):
        super().__init__()
        self.post = self.run  # (a bound method of the graphed root, kept on it)

    def forward(self, x):
        return self.post(x)


class RootTripler(Root):
    def apply_to(self, h):
        return h * 3


def test_g10_control_the_roots_own_bound_method_class_swap_and_lifetime(sim):
    m = Root()
    g = cg.graphify(m)
    assert _outputs(g, lambda: setattr(m, "__class__", RootTripler)) == SWAPPED
    ref = weakref.ref(m)
    del g, m
    gc.collect()
    assert ref() is None


def test_g10_control_a_kept_bound_methods_module_is_held_weakly_by_the_check(sim):
    d = Doubler()
    checks: list = []
    _guards._watch_callable(d.run, checks, [], set(), 0)
    found = [c for c in checks if type(c) is _guards._ClassCheck]
    assert found and all(c.ref() is d for c in found)
    ref = weakref.ref(d)
    del d
    gc.collect()
    assert ref() is None
