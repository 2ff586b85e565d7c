"""Review of 324be88 (graphify's guard compares the classes of its tree's modules and of
modules found in what it read; ``watch()`` on those modules; enum members' attributes that are
members keyed by identity; strict_key's enum branch before the float one).

Findings (strict xfails, each failing at review because of the finding; controls pass). All
are fixed since (plain tests now), but G8-3, whose saving was given back for review guard9's
G9-1 (a class written past nn.Module.__setattr__ moves no tree epoch: the classes are compared
on every epoch move again); its test is gone, its control stays:

- G8-1 (stale, B7-1's fix incomplete): a module reached through a closure cell (a graphed
  function's own, or the closure of a function kept as a module attribute) or a weak reference
  kept as an attribute, whose method (not its forward) runs: ``m.__class__ = Other`` replays
  the stale graph. ``function_bindings`` holds closure values by identity only;
  ``_watch_callable`` skips modules in closures (not in ``_WATCHED_IN_CLOSURES``) and a weak
  reference's module target: no ``_ClassCheck``, no watch, no epoch move.
- G8-2 (per-call cost, new): a module outside the tree that merely sits in a container or
  object the forward reads (``self.holder.scale``, the holder also keeping ``helper``) is now
  ``watch()``ed: each of its attribute writes moves the epoch (every graph runs ``_changed``
  on its next call) and each of its registry writes (``helper.buf = t``) moves the statics
  generation (every graph re-scans its whole tree on its next call).
- G8-3 (per-call cost, new): ``_changed`` walks ``_tree`` (every module of the tree, weakly
  held) on every epoch move, a plain attribute write too, where only a ``__class__`` write
  (which moves the tree epoch) can change what it compares.
- G8-4 (stale, new): an enum member's attribute that is another member is keyed by identity
  only: that other member's own attribute set anew (``Mode.SLOW.scale = 3.0``, read as
  ``mode.fallback.scale`` with ``Mode.FAST`` passed) is not in the key any more (it was,
  keyed recursively, before).
- G8-5 (per-call cost, new): ``strict_key`` asks ``isinstance(value, enum.Enum)`` before the
  float branch: every float leaf of every call on the fast path (``_mixed_ok``) pays it.

Graphify runs through the simulated backend (conftest.py).
"""

from __future__ import annotations

import enum
import functools
import types
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _guards, _signature, _statics

pytestmark = pytest.mark.usefixtures("quiet")


class Doubler(nn.Module):
    def apply_to(self, h):
        return h * 2

    def run(self, h):  # (a method that calls another through ``self``)
        return self.apply_to(h)


class Tripler(Doubler):
    def apply_to(self, h):
        return h * 3


def _swapped_after_replays(g, target, call=lambda g: g(torch.ones(2))):
    """Call ``g`` five times, ``target``'s class swapped to Tripler before the fourth: each
    output must be what the module computes now."""
    with torch.no_grad():
        for i in range(5):
            if i == 3:
                target.__class__ = Tripler
            want = 3.0 if i >= 3 else 2.0
            got = call(g)[0].item()
            assert got == want, f"call {i}: {got} where eager gives {want} (a stale graph)"


# -- G8-1: a class swapped on a module reached through a closure or a weak reference ------------

def _graphed_closure():
    d = Doubler()

    def f(x):
        return d.apply_to(x)
    return cg.graphify(f), d


class WithPost(nn.Module):
    def __init__(self, post):
        super().__init__()
        self.post = post

    def forward(self, x):
        return self.post(x)


def _function_attribute_closure():
    d = Doubler()

    def post(x):
        return d.apply_to(x)
    return cg.graphify(WithPost(post)), d


class WithWeak(nn.Module):
    def __init__(self, target):
        super().__init__()
        self.ref = weakref.ref(target)

    def forward(self, x):
        return self.ref().apply_to(x)


def _weakref_attribute():
    d = Doubler()
    return cg.graphify(WithWeak(d)), d  # (``d`` held by the test: alive)


GAPS = {
    "a graphed function's closure cell": _graphed_closure,
    "the closure of a function kept as an attribute": _function_attribute_closure,
    "a weak reference kept as an attribute": _weakref_attribute,
}


@pytest.mark.parametrize("where", list(GAPS))
def test_g8_1_class_swapped_on_a_closure_or_weakref_module(sim, where):
    g, d = GAPS[where]()
    _swapped_after_replays(g, d)


class WithHolder(nn.Module):
    def __init__(self, holder):
        super().__init__()
        self.holder = holder

    def forward(self, x):
        return self.holder.d["m"].apply_to(x)


class WithTuple(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.__dict__["t"] = (d,)

    def forward(self, x):
        return self.t[0].apply_to(x)


def _apply(mod, x):
    return mod.apply_to(x)


def _in_holder():
    d = Doubler()
    return cg.graphify(WithHolder(types.SimpleNamespace(d={"m": d}))), d


def _in_tuple():
    d = Doubler()
    return cg.graphify(WithTuple(d)), d


def _in_partial():
    d = Doubler()
    return cg.graphify(WithPost(functools.partial(_apply, d))), d


COVERED = {"a dict in a plain object": _in_holder, "a tuple attribute": _in_tuple,
           "a partial's bound argument": _in_partial}


@pytest.mark.parametrize("where", list(COVERED))
def test_g8_1_control_a_module_in_a_read_container_swapped_is_seen(sim, where):
    g, d = COVERED[where]()
    _swapped_after_replays(g, d)


# -- G8-2: modules merely found in a read container are watched ---------------------------------

class ReadsHolder(nn.Module):
    def __init__(self, holder):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.holder = holder

    def forward(self, x):
        return self.lin(x) * self.holder.scale  # (the holder's other items: never touched)


def _counting(monkeypatch):
    counts = {"changed": 0, "rescan": 0}
    changed, rescan = _guards.StateGuard._changed, _statics.StaticState.rescan

    def counting_changed(self):
        counts["changed"] += 1
        return changed(self)

    def counting_rescan(self):
        counts["rescan"] += 1
        return rescan(self)
    monkeypatch.setattr(_guards.StateGuard, "_changed", counting_changed)
    monkeypatch.setattr(_statics.StaticState, "rescan", counting_rescan)
    return counts


def _writes_per_call(sim, monkeypatch, in_holder: bool):
    helper = nn.Linear(2, 2)
    helper.register_buffer("buf", torch.zeros(2))
    holder = types.SimpleNamespace(scale=2.0, mods=[helper] if in_holder else [])
    g = cg.graphify(ReadsHolder(holder).eval())
    x = torch.randn(3, 4)
    bufs = [torch.zeros(2), torch.ones(2)]
    with torch.no_grad():
        for _ in range(3):
            g(x)
        captures = cg.stats(g).captures
        counts = _counting(monkeypatch)
        for i in range(6):
            helper.step = i  # (the user's own bookkeeping on a module no graph runs or reads)
            helper.buf = bufs[i % 2]  # (a buffer assigned anew: a registry write)
            g(x)
    assert cg.stats(g).captures == captures
    return counts


def test_g8_2_writes_to_a_module_the_forward_never_touches_cost_nothing(sim, monkeypatch):
    counts = _writes_per_call(sim, monkeypatch, in_holder=True)
    assert counts == {"changed": 0, "rescan": 0}, counts


def test_g8_2_control_writes_to_an_unrelated_module_cost_nothing(sim, monkeypatch):
    counts = _writes_per_call(sim, monkeypatch, in_holder=False)
    assert counts == {"changed": 0, "rescan": 0}, counts


# -- G8-3: the tree's classes compared on every epoch move -------------------------------------

class _CountingList(list):
    walks = 0

    def __iter__(self):
        _CountingList.walks += 1
        return super().__iter__()


def _tree_walks(sim, monkeypatch, write):
    init = _guards.StateGuard.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._tree = _CountingList(self._tree)
    monkeypatch.setattr(_guards.StateGuard, "__init__", counting_init)
    m = BySub()
    g = cg.graphify(m)
    with torch.no_grad():
        for _ in range(3):
            g(torch.ones(2))
        _CountingList.walks = 0
        write(m)
        out = g(torch.ones(2))
    return _CountingList.walks, out


class BySub(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = Doubler()

    def forward(self, x):
        return self.s.apply_to(x)


def test_g8_3_control_a_class_swap_is_seen(sim, monkeypatch):
    walks, out = _tree_walks(sim, monkeypatch, lambda m: setattr(m.s, "__class__", Tripler))
    assert out[0].item() == 3.0


# -- G8-4: an enum member's attribute naming another member ------------------------------------

class Mode(enum.Enum):
    FAST = 1
    SLOW = 2


def _linked_member_call(attr_owner: str):
    Mode.SLOW.scale = 2.0
    Mode.FAST.scale = 2.0
    Mode.FAST.fallback = Mode.SLOW

    def f(x, mode):
        return x * (mode.fallback.scale if attr_owner == "SLOW" else mode.scale)
    g = cg.graphify(f)
    try:
        with torch.no_grad():
            for i in range(5):
                if i == 3:
                    getattr(Mode, attr_owner).scale = 3.0
                want = 3.0 if i >= 3 else 2.0
                got = g(torch.ones(2), Mode.FAST)[0].item()
                assert got == want, f"call {i}: {got} where eager gives {want} (a stale graph)"
    finally:
        for member in Mode:
            member.__dict__.pop("scale", None)
            member.__dict__.pop("fallback", None)


def test_g8_4_a_linked_members_attribute_set_anew_is_seen(sim):
    _linked_member_call("SLOW")


def test_g8_4_control_the_members_own_attribute_set_anew_is_seen(sim):
    _linked_member_call("FAST")


def test_g8_4_control_members_naming_each_other_key_finitely():
    class Dir(enum.Enum):
        UP = 1
        DOWN = 2
    Dir.UP.opposite, Dir.DOWN.opposite = Dir.DOWN, Dir.UP
    assert _signature.strict_key(Dir.UP) != _signature.strict_key(Dir.DOWN)


# -- G8-5: a float pays the enum check ---------------------------------------------------------

class _CountingMeta(type):
    checks = 0

    def __instancecheck__(cls, obj):
        _CountingMeta.checks += 1
        return isinstance(obj, enum.Enum)


class _CountingEnum(metaclass=_CountingMeta):
    pass


def _enum_checks(monkeypatch, value) -> int:
    monkeypatch.setattr(_signature, "enum",
                        types.SimpleNamespace(Enum=_CountingEnum, Flag=enum.Flag))
    _CountingMeta.checks = 0
    key = _signature.strict_key(value)
    monkeypatch.undo()
    assert key == _signature.strict_key(value)
    return _CountingMeta.checks


def test_g8_5_a_float_key_asks_no_enum_check(monkeypatch):
    assert _enum_checks(monkeypatch, 1.5) == 0


def test_g8_5_control_a_plain_int_asks_none(monkeypatch):
    assert _enum_checks(monkeypatch, 3) == 0
