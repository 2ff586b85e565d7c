"""Review of ec99ad7 (bucketed's host-read check: rules' and aten's tags, frozen parameters)
and b3bcbb9 (``is_constant``: a constant type's subclass with an instance dict is no constant).

Each finding was a strict xfail, each with a passing control; all four are fixed since (the
B3 tests now pass plainly). Elementwise models on the CPU (padded
and unpadded outputs equal bit for bit); graphify runs through the simulated backend."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg
from cudagraphify._signature import is_constant

from test_bucket_state import _rowwise, _served

pytestmark = pytest.mark.usefixtures("quiet")


def _bucketed_ok(make):
    torch.manual_seed(0)
    ref = make()
    b = _served(copy.deepcopy(ref), ref)
    assert not b.refused, list(b.refused.values())
    assert len(b.verified) == 1 and b.padded_calls == 2 + 2


# -- B3-1: repeat_interleave by an int counted as a host read ---------------------------------

class Interleaved(nn.Module):
    """A per-feature scale kept as a buffer, widened by ``repeat_interleave(2)`` (GPT-J's and
    CodeGen's rotary ``torch.repeat_interleave(sin, 2, 3)``, on a tensor attribute) or by
    expand/reshape (the same values)."""

    def __init__(self, interleave: bool):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("halves", torch.randn(2))
        self.interleave = interleave

    def forward(self, x):
        scale = self.halves.repeat_interleave(2) if self.interleave \
            else self.halves[:, None].expand(2, 2).reshape(4)
        return _rowwise(x, self.w) * scale


def test_control_a_buffer_widened_by_expand_is_bucketed(sim):
    _bucketed_ok(lambda: Interleaved(False))


def test_a_buffer_widened_by_repeat_interleave_int_is_bucketed(sim):
    _bucketed_ok(lambda: Interleaved(True))


# -- B3-2: one_hot with num_classes counted as a host read ------------------------------------

class OneHot(nn.Module):
    """Fixed class ids kept in a buffer, one-hot encoded with ``num_classes`` given (Mixtral's
    ``one_hot(top_k_index, num_classes=...)``), or by a comparison (the same values)."""

    def __init__(self, one_hot: bool):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("ids", torch.tensor([0, 1, 1, 0]))
        self.one_hot = one_hot

    def forward(self, x):
        oh = F.one_hot(self.ids, num_classes=2) if self.one_hot \
            else (self.ids[:, None] == torch.arange(2)).long()
        return _rowwise(x, self.w) * oh[:, 1]


def test_control_a_one_hot_by_comparison_of_a_buffer_is_bucketed(sim):
    _bucketed_ok(lambda: OneHot(False))


def test_a_one_hot_of_a_buffer_with_num_classes_is_bucketed(sim):
    _bucketed_ok(lambda: OneHot(True))


# -- B3-3: a frozen model's weights all count as state ----------------------------------------

class Routed(nn.Module):
    """Row-wise routing by a host read of what the weights made of the input (an MoE's
    ``nonzero``/``where(mask)`` dispatch): each row's output depends on its own row only."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = x @ self.w
        rows = torch.nonzero(h.sum(1) > 0).squeeze(1)
        out = torch.zeros_like(h)
        out[rows] = torch.tanh(h[rows])
        return out


def _routed(frozen: bool):
    m = Routed()
    m.requires_grad_(not frozen)
    return m


def test_control_routing_with_trainable_weights_is_bucketed(sim):
    _bucketed_ok(lambda: _routed(False))


def test_routing_with_frozen_weights_is_bucketed(sim):
    _bucketed_ok(lambda: _routed(True))


# -- B3-4: a float subclass with __slots__ carries attributes and is still a constant ---------

class SlottedScale(float):
    __slots__ = ("center",)  # (float and complex take non-empty slots; str, int, bytes don't)


class DictScale(float):
    pass


class Branchy(nn.Module):
    def forward(self, x, mode):
        return x * 2 if getattr(mode, "center", False) else x * 3


def _attribute_flipped(sim, cls):
    m, g = Branchy(), cg.graphify(Branchy())
    mode = cls(2.0)
    mode.center = False
    with torch.no_grad():
        for i in range(4):
            if i == 2:
                mode.center = True
            x = torch.randn(4)
            assert torch.equal(g(x, mode), m(x, mode)), f"call {i}: stale graph"


def test_control_a_float_subclass_with_a_dict_sees_its_attribute_change(sim):
    assert not is_constant(DictScale(2.0))
    _attribute_flipped(sim, DictScale)


def test_a_slotted_float_subclass_sees_its_attribute_change(sim):
    _attribute_flipped(sim, SlottedScale)
