"""Review of 3e031d6 (bucketed's host_read: no aten tags for the functions a rule decides, nor
for ``one_hot`` given its classes; frozen float weights of several values are data; is_constant:
a constant type's subclass that declares slots is no constant).

Each finding was a strict xfail with a passing control; all are fixed since (plain tests now).
Elementwise models on the CPU (padded
and unpadded outputs equal bit for bit); graphify runs through the simulated backend. A state
read that the check should have refused shows as a silent wrong result once that state is
changed in place after the check (``fill_``: no attribute written)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg
from cudagraphify._policy import host_read
from cudagraphify._signature import is_constant

from test_bucket_state import _served
from test_review_bucket2 import _center, _rowwise

pytestmark = pytest.mark.usefixtures("quiet")


class Stateful(nn.Module):
    """Centres the batch (rows interact) where ``gate(self)``, a host read of state, is true."""

    def __init__(self, gate, **state):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        for name, t in state.items():
            if isinstance(t, nn.Parameter):
                setattr(self, name, t)
            else:
                self.register_buffer(name, t)
        self.gate = gate

    def forward(self, x):
        h = _rowwise(x, self.w)
        return _center(h) if self.gate(self) else h


def _changed_after_check(make, change, graph=False):
    """Serve (the check runs), change the state in place in both twins, serve again."""
    torch.manual_seed(0)
    ref = make()
    m = copy.deepcopy(ref)
    b = _served(cg.graphify(m) if graph else m, ref)
    for mod in (ref, m):
        with torch.no_grad():
            change(mod)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 4)
            assert torch.equal(b(x.clone()), ref(x.clone())), "padded rows joined the batch"
    return b


# -- B4-1: one-argument repeat_interleave(counts) lost its host read --------------------------

def _interleaved_counts(positional_repeats: bool):
    # torch.repeat_interleave(counts): indices, a shape made of counts' values (a sync on
    # CUDA), as x.repeat_interleave(counts) is
    if positional_repeats:
        gate = lambda self: torch.arange(2).repeat_interleave(self.counts).shape[0] > 0
    else:
        gate = lambda self: torch.repeat_interleave(self.counts).shape[0] > 0
    return Stateful(gate, counts=torch.zeros(2, dtype=torch.long))


def test_b4_1_unit_one_argument_repeat_interleave_reads_values():
    c = torch.tensor([1, 2])
    assert host_read(torch.Tensor.repeat_interleave, (torch.arange(2), c), {})  # (control)
    assert torch.repeat_interleave(c).shape[0] == 3  # (its shape is made of c's values)


def test_b4_1_unit_one_argument_repeat_interleave_is_a_host_read():
    c = torch.tensor([1, 2])
    assert host_read(torch.repeat_interleave, (c,), {})
    assert host_read(torch.repeat_interleave, (), {"input": c})


def test_b4_1_control_repeats_of_a_buffer_refuse_and_stay_right(sim):
    b = _changed_after_check(lambda: _interleaved_counts(True), lambda m: m.counts.fill_(1))
    assert any("reads on the host" in why for why in b.refused.values())


def test_b4_1_one_argument_repeat_interleave_of_a_buffer_stays_right(sim):
    _changed_after_check(lambda: _interleaved_counts(False), lambda m: m.counts.fill_(1))


# -- B4-2: a frozen float mask of several values is a flag, now counted as a weight -----------

def _masked(n: int):
    mask = nn.Parameter(torch.zeros(n), requires_grad=False)
    return Stateful(lambda self: bool(self.mask.any()), mask=mask)


def test_b4_2_control_a_frozen_one_value_mask_refuses_and_stays_right(sim):
    b = _changed_after_check(lambda: _masked(1), lambda m: m.mask.fill_(1.0))
    assert any("reads on the host" in why for why in b.refused.values())


def test_b4_2_a_frozen_float_mask_of_several_values_stays_right(sim):
    _changed_after_check(lambda: _masked(4), lambda m: m.mask.fill_(1.0))


# -- B4-3: a frozen one-value weight (nn.PReLU()'s) refuses routing on the data ---------------

class PReLURouted(nn.Module):
    """Row-wise routing (an MoE's nonzero dispatch) of what the weights made of the input,
    through nn.PReLU() (one learned slope: a one-value weight)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.act = nn.PReLU()

    def forward(self, x):
        h = self.act(x @ self.w)
        rows = torch.nonzero(h.sum(1) > 0).squeeze(1)
        out = torch.zeros_like(h)
        out[rows] = torch.tanh(h[rows])
        return out


def _prelu_routed(frozen: bool):
    m = PReLURouted()
    m.requires_grad_(not frozen)
    return m


def _bucketed_ok(make):
    torch.manual_seed(0)
    ref = make()
    b = _served(copy.deepcopy(ref), ref)
    assert not b.refused, list(b.refused.values())
    assert len(b.verified) == 1 and b.padded_calls == 2 + 2


def test_b4_3_control_prelu_routing_with_trainable_weights_is_bucketed(sim):
    _bucketed_ok(lambda: _prelu_routed(False))


def test_b4_3_prelu_routing_with_frozen_weights_is_bucketed(sim):
    _bucketed_ok(lambda: _prelu_routed(True))


# -- B4-4 / B4-5: attributes the slots check does not see -------------------------------------

class ListSlots(float):
    __slots__ = ["center"]


class GenSlots(float):
    __slots__ = (n for n in ["center"])  # (consumed by type(); the class keeps it, empty)


class SlottedSet(frozenset):
    __slots__ = ("center",)


class DictSet(frozenset):
    pass


class Branchy(nn.Module):
    def forward(self, x, mode):
        return x * 2 if getattr(mode, "center", False) else x * 3


def _attribute_flipped(make):
    m, g = Branchy(), cg.graphify(Branchy())
    mode = make()
    mode.center = False
    with torch.no_grad():
        for i in range(4):
            if i == 2:
                mode.center = True
            x = torch.randn(4)
            assert torch.equal(g(x, mode), m(x, mode)), f"call {i}: stale graph"


def test_b4_4_control_list_slots_see_the_attribute_change(sim):
    assert not is_constant(ListSlots(2.0))
    _attribute_flipped(lambda: ListSlots(2.0))


def test_b4_4_generator_slots_see_the_attribute_change(sim):
    _attribute_flipped(lambda: GenSlots(2.0))


def test_b4_5_control_a_frozenset_subclass_with_a_dict_sees_the_attribute_change(sim):
    _attribute_flipped(lambda: DictSet([1]))


def test_b4_5_a_slotted_frozenset_subclass_sees_the_attribute_change(sim):
    _attribute_flipped(lambda: SlottedSet([1]))


# -- B4-6 (not from 3e031d6): where(condition=...) and a uint8 mask miss the rules ------------

def _where_mask(kw: bool):
    gate = (lambda self: torch.where(condition=self.mask)[0].numel() > 0) if kw else \
        (lambda self: torch.where(self.mask)[0].numel() > 0)
    return Stateful(gate, mask=torch.zeros(4, dtype=torch.bool))


def test_b4_6_control_where_of_a_buffer_refuses_and_stays_right(sim):
    b = _changed_after_check(lambda: _where_mask(False), lambda m: m.mask.fill_(True))
    assert any("reads on the host" in why for why in b.refused.values())


def test_b4_6_where_by_keyword_of_a_buffer_stays_right(sim):
    _changed_after_check(lambda: _where_mask(True), lambda m: m.mask.fill_(True))


def test_b4_6_unit_a_uint8_mask_index_is_a_host_read():
    x = torch.zeros(3)
    assert host_read(torch.Tensor.__getitem__, (x, torch.tensor([True, False, True])), {})
    assert host_read(torch.Tensor.__getitem__, (x, torch.tensor([1, 0, 1], dtype=torch.uint8)),
                     {})


# -- hunts that came out right ----------------------------------------------------------------

def test_one_hot_given_its_classes_raises_on_an_out_of_range_class():
    # (no value reaches Python: a class out of range raises; nothing silent)
    assert not host_read(F.one_hot, (torch.tensor([0, 1]),), {"num_classes": 2})
    assert host_read(F.one_hot, (torch.tensor([0, 1]),), {})
    with pytest.raises(RuntimeError):
        F.one_hot(torch.tensor([0, 3]), num_classes=2)


def test_ruled_functions_still_read_by_their_arguments():
    x, m, i = torch.zeros(3), torch.tensor([True, False, True]), torch.tensor([0, 2])
    T = torch.Tensor
    assert host_read(torch.where, (m,), {}) and not host_read(torch.where, (m, x, x), {})
    assert host_read(T.__getitem__, (x, m), {}) and not host_read(T.__getitem__, (x, i), {})
    assert host_read(T.__getitem__, (x, (slice(None), m)), {})
    assert host_read(torch.index_put, (x, (m,), torch.tensor(1.0)), {})
    assert not host_read(torch.index_put, (x, (i,), torch.tensor(1.0)), {})
    assert host_read(T.repeat_interleave, (x, i), {}) and \
        not host_read(T.repeat_interleave, (x, 2), {})
    assert not host_read(T.repeat_interleave, (x, torch.tensor([1, 1, 1])), {"output_size": 3})
    assert not host_read(F.dropout, (x,), {"p": 0.5})
    assert host_read(T.cpu, (x,), {})


def test_constant_subclasses_that_came_out_right():
    class A(float):
        pass

    class B(A):
        __slots__ = ()  # (the dict comes from A)

    class D(float):
        __slots__ = {"center": "doc"}

    class W(float):
        __slots__ = ("__weakref__",)

    import numpy as np
    assert not is_constant(B(1.0)) and not is_constant(D(1.0))
    assert is_constant(W(1.0)) and is_constant(np.float64(1.0)) and is_constant(True)
    with pytest.raises(TypeError):
        type("S", (torch.Size,), {})
