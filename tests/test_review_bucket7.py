"""Review of e9ac369 (bucketed: ``_HostReads`` holds no weak references; cudagraphify's own
calls' results labelled state) and f7d8cfe (graphify's guard compares the classes of the
modules read; ``__class__`` and hooks-dict writes move the tree epoch; enum members keyed
with their own attributes; ``_sources``/``_written``/``_tensors_of`` in bucketed).

Findings (strict xfails, each failing at review because of the finding; controls pass). All
are fixed since (plain tests now):

- B7-1 (older; B6-6's graphify half incomplete): graphify alone replays a stale graph after
  ``m.s.__class__ = Other`` where the forward calls a method of ``s`` (not ``s(x)``) and ``s``
  is a registered submodule (directly, in a ModuleList), a module in a plain list, the root
  itself, or a module kept as a plain attribute (f7d8cfe's own case: read, but no submodule,
  so not watched and its class write moves no epoch): a submodule read through the
  registries is no recorded read, so ``StateGuard._classes`` never holds it, and only
  modules *called* are in ``_ran``.
- B7-2 (crash, new in f7d8cfe): an enum member whose own attribute is another member (or
  itself), ``Dir.UP.opposite = Dir.DOWN``: ``_constant_member`` and ``strict_key`` recurse
  without end; a graphed module holding one, a graphed or bucketed call passing one, raise
  RecursionError.
- B7-3 (needless refusal, new in f7d8cfe): an enum member with a function (or class)
  attribute set in ``__init__`` is no constant any more: the graphed call runs eagerly on
  every call (it replayed before).
- B7-4 (older; f7d8cfe's ``_META_ONLY`` keeps it): a tensor argument of ``new_tensor``,
  ``new_full`` or ``full_like`` that gives the values (``x.new_tensor(self.p)``,
  ``torch.full_like(x, self.p[0])``) is no source: a flag kept in a parameter, read on the
  host that way, is not refused; changed in place after the check, padding goes on.
- B7-5 (older; B6-7's fix incomplete): state set up on first use in a dict subclass or an
  object attribute (``SimpleNamespace``), then read on the host: ``_tensors_of`` looks into
  plain lists, tuples and dicts only (pytree leaves a dict subclass whole).

Elementwise models, so that padded and unpadded outputs are equal bit for bit on the CPU;
graphify runs through the simulated backend (conftest.py).
"""

from __future__ import annotations

import copy
import enum
import http
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg
from cudagraphify._signature import is_constant, strict_key

from test_review_bucket2 import _center, _rowwise
from test_review_bucket4 import _changed_after_check
from test_review_bucket5 import Gx, _flag_set, _refused_as_state

pytestmark = pytest.mark.usefixtures("quiet")


# -- B7-1: a class swapped on a module graphify does not record ---------------------------------

class Doubler(nn.Module):
    def apply_to(self, h):
        return h * 2


class Tripler(Doubler):
    def apply_to(self, h):
        return h * 3

    def forward(self, h):
        return h * 3


class BySubmodule(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = Doubler()

    def forward(self, x):
        return self.s.apply_to(x)


class ByModuleList(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Doubler()])

    def forward(self, x):
        return self.layers[0].apply_to(x)


class ByPlainList(nn.Module):
    def __init__(self):
        super().__init__()
        self.fns = [Doubler()]

    def forward(self, x):
        return self.fns[0].apply_to(x)


class ByOwnMethod(nn.Module):
    def apply_to(self, h):
        return h * 2

    def forward(self, x):
        return self.apply_to(x)


class ByOwnMethod3(ByOwnMethod):
    def apply_to(self, h):
        return h * 3


class ByCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Identity()

    def forward(self, x):
        return self.s(x)


class ByPlainAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.__dict__["s"] = Doubler()  # (no submodule: a plain attribute, a recorded read)

    def forward(self, x):
        return self.s.apply_to(x)


class ByAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = Doubler()
        self.__dict__["alias"] = self.s  # (a submodule read through a plain attribute)

    def forward(self, x):
        return self.alias.apply_to(x)


def _class_swapped(make, swap):
    """Graphify a twin, swap the class in both after the graph replays, compare."""
    ref, m = make(), make()
    g = cg.graphify(m)
    with torch.no_grad():
        for i in range(5):
            if i == 3:
                swap(ref)
                swap(m)
            x = torch.randn(4)
            assert torch.equal(g(x), ref(x)), f"call {i}: a stale graph replayed"
    return g


SWAPS = {
    "submodule's method": (BySubmodule, lambda m: setattr(m.s, "__class__", Tripler)),
    "ModuleList item's method": (ByModuleList,
                                 lambda m: setattr(m.layers[0], "__class__", Tripler)),
    "plain list item's method": (ByPlainList, lambda m: setattr(m.fns[0], "__class__", Tripler)),
    "the root's own method": (ByOwnMethod, lambda m: setattr(m, "__class__", ByOwnMethod3)),
    # (read as a plain attribute, f7d8cfe's case, but no submodule: not watched, no epoch moves)
    "plain attribute's method": (ByPlainAttribute,
                                 lambda m: setattr(m.s, "__class__", Tripler)),
}


@pytest.mark.parametrize("where", list(SWAPS))
def test_b7_1_a_class_swapped_on_a_module_whose_method_runs_is_seen(sim, where):
    make, swap = SWAPS[where]
    _class_swapped(make, swap)


CONTROL_SWAPS = {
    "submodule called": (ByCall, lambda m: setattr(m.s, "__class__", Tripler)),
    "submodule read through a plain attribute": (ByAlias,
                                                 lambda m: setattr(m.s, "__class__", Tripler)),
}


@pytest.mark.parametrize("where", list(CONTROL_SWAPS))
def test_b7_1_control_a_called_module_swapped_is_seen(sim, where):
    make, swap = CONTROL_SWAPS[where]
    _class_swapped(make, swap)


# -- B7-2: enum members that refer to each other --------------------------------------------------

class Dir(enum.Enum):
    UP = 1
    DOWN = 2


Dir.UP.opposite = Dir.DOWN  # (a common pattern: set once the members exist)
Dir.DOWN.opposite = Dir.UP


class Loop(enum.Enum):
    ONE = 1


Loop.ONE.me = Loop.ONE


def _no_recursion(fn):
    try:
        return fn()
    except RecursionError:
        raise AssertionError("RecursionError") from None


@pytest.mark.parametrize("member", [Dir.UP, Loop.ONE], ids=["each other", "itself"])
def test_b7_2_unit_members_referring_to_members_are_keyed(member):
    assert _no_recursion(lambda: is_constant(member))
    assert _no_recursion(lambda: strict_key(member)) == strict_key(member)


class TimesValue(nn.Module):
    def forward(self, x, d):
        return x * d.value


class HoldsMember(nn.Module):
    def __init__(self, member):
        super().__init__()
        self.d = member

    def forward(self, x):
        return x * self.d.value


@pytest.mark.parametrize("how", ["argument", "attribute"])
def test_b7_2_a_graphed_call_with_such_a_member_runs(sim, how):
    g = cg.graphify(TimesValue() if how == "argument" else HoldsMember(Dir.UP))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4)
            out = _no_recursion(lambda: g(x, Dir.UP) if how == "argument" else g(x))
            assert torch.equal(out, x)


def test_b7_2_a_bucketed_call_with_such_a_member_runs(sim):
    b = cg.bucketed(TimesValue(), [4, 8])
    with torch.no_grad():
        x = torch.randn(3, 4)
        assert torch.equal(_no_recursion(lambda: b(x, Dir.UP)), x)


class Plain(enum.Enum):
    ONE = 1


def test_b7_2_control_a_member_holding_a_member_of_another_enum_is_a_constant():
    class Holder(enum.Enum):
        A = 1
    Holder.A.other = Plain.ONE
    assert is_constant(Holder.A)


# -- B7-3: members with a function or class attribute refused since f7d8cfe ---------------------

class Act(enum.Enum):
    RELU = "relu"
    GELU = "gelu"

    def __init__(self, name):
        self.fn = {"relu": F.relu, "gelu": F.gelu}[name]  # (code, kept with the member)


class Applies(nn.Module):
    def forward(self, x, how):
        return how.fn(x) if isinstance(how, Act) else x * 2


def _replays(member):
    g = cg.graphify(Applies())
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(4), member)
    return cg.stats(g).replays


@pytest.mark.parametrize("member", [Act.RELU], ids=["function attribute"])
def test_b7_3_a_member_with_a_code_attribute_replays(sim, member):
    assert _replays(member) == 2


@pytest.mark.parametrize("member", [Plain.ONE, http.HTTPStatus.OK], ids=["plain", "HTTPStatus"])
def test_b7_3_control_members_with_constant_attributes_replay(sim, member):
    assert _replays(member) == 2


# -- B7-4: a tensor argument that gives the values, dropped as metadata ---------------------------

VALUES_FROM_AN_ARGUMENT = {
    "x.new_tensor(p)": lambda self, x: bool(x.new_tensor(self.p).any()),
    "x.new_full((1,), p[0])": lambda self, x: bool(x.new_full((1,), self.p[0]).any()),
    "full_like(x, p[0])": lambda self, x: bool(torch.full_like(x[:1, 0], self.p[0]).any()),
}


@pytest.mark.parametrize("read", list(VALUES_FROM_AN_ARGUMENT))
def test_b7_4_weights_given_as_a_fill_or_data_argument_then_read_stay_right(sim, read):
    _changed_after_check(lambda: Gx(VALUES_FROM_AN_ARGUMENT[read]), _flag_set)


@pytest.mark.parametrize("read", ["full((1,), p[0])", "zeros_like(x).add_(p)",
                                  "Tensor.to(p, x)"])
def test_b7_4_control_weights_as_a_source_refuse_and_stay_right(sim, read):
    gate = {"full((1,), p[0])": lambda self, x: bool(torch.full((1,), self.p[0]).any()),
            "zeros_like(x).add_(p)":
                lambda self, x: bool(torch.zeros_like(x[:1, 0]).add_(self.p).any()),
            "Tensor.to(p, x)": lambda self, x: bool(torch.Tensor.to(self.p, x).any())}[read]
    b = _changed_after_check(lambda: Gx(gate), _flag_set)
    assert _refused_as_state(b)


# -- B7-5: state set up in containers _tensors_of does not open ----------------------------------

class Namespaced(dict):
    """A dict subclass (pytree leaves it whole)."""


class SetUpIn(nn.Module):
    """Sets up a flag (128 values: no CPU scalar a guard reads by value) on its first call in
    ``self.cache``, and centres the batch where it is set."""

    def __init__(self, make):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.cache = make()

    def flag(self):
        c = self.cache
        return c.f if isinstance(c, types.SimpleNamespace) else c["f"]

    def forward(self, x):
        h = _rowwise(x, self.w)
        c = self.cache
        if isinstance(c, types.SimpleNamespace):
            if not hasattr(c, "f"):
                c.f = torch.zeros(128)
        elif "f" not in c:
            c["f"] = torch.zeros(128)
        return _center(h) if bool(self.flag().any()) else h


@pytest.mark.parametrize("make", [Namespaced, types.SimpleNamespace],
                         ids=["dict subclass", "SimpleNamespace"])
def test_b7_5_state_set_up_in_another_container_then_changed_stays_right(sim, make):
    _changed_after_check(lambda: SetUpIn(make), lambda m: m.flag().fill_(1.0))


def test_b7_5_control_state_set_up_in_a_dict_refuses_and_stays_right(sim):
    b = _changed_after_check(lambda: SetUpIn(dict), lambda m: m.flag().fill_(1.0))
    assert _refused_as_state(b)


# -- checked, came out right -------------------------------------------------------------------

class Flags(enum.IntFlag):
    A = 1
    B = 2


def test_enum_keys_that_came_out_right():
    combo = Flags.A | Flags.B  # (a pseudo-member made on the fly: cached, keyed alike)
    assert is_constant(combo) and strict_key(combo) == strict_key(Flags.A | Flags.B)
    assert strict_key(http.HTTPStatus.OK) != strict_key(http.HTTPStatus.CREATED)


def test_lazy_module_materialising_replays(sim):
    torch.manual_seed(0)
    g = cg.graphify(nn.Sequential(nn.LazyLinear(4), nn.Tanh()))  # (its class changes)
    with torch.no_grad():
        for _ in range(4):
            g(torch.randn(2, 3))
    assert cg.stats(g).replays == 2 and cg.stats(g).invalidations == 0
