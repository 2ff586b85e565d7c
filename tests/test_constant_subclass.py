"""A subclass of a constant type whose instances carry attributes (``class Mode(str)`` with
``mode.center``) is no constant: a signature keyed by its value would replay a graph captured
with the attribute as it was (review bucket2's B2-8, found through ``bucketed``; graphify's own
keys too). It is an opaque argument: that call runs eagerly, with the reason."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._signature import is_constant

pytestmark = pytest.mark.usefixtures("quiet")


class Mode(str):
    pass


class Slotted(str):
    __slots__ = ()


class Kind(str, enum.Enum):
    A = "a"


class Level(enum.IntEnum):
    LOW = 1


class Scale(float):
    pass


@pytest.mark.parametrize("value, want", [
    (Mode("a"), False), (Scale(2.0), False),  # (instances that may carry attributes)
    (Slotted("a"), True), (Kind.A, True), (Level.LOW, True), (np.float64(1.5), True),
    ("a", True), (2.0, True), (torch.Size([2, 3]), True), (range(3), True), (None, True),
    ((1, Slotted("b")), True), ((1, Mode("b")), False),
])
def test_which_values_are_constants(value, want):
    assert is_constant(value) is want


class Branchy(nn.Module):
    def forward(self, x, mode):
        return x * 2 if getattr(mode, "center", False) else x * 3


def test_an_attribute_set_on_a_str_subclass_argument_is_seen(sim):
    m, g = Branchy(), cg.graphify(Branchy())
    mode = Mode("a")
    with torch.no_grad():
        for i in range(4):
            if i == 2:
                mode.center = True
            x = torch.randn(4)
            assert torch.equal(g(x, mode), m(x, mode))
    s = cg.stats(g)
    assert s.replays == 0 and any("Mode" in why for why in s.eager_calls), s


def test_a_slotted_str_subclass_is_keyed_by_value_and_replays(sim):
    m, g = Branchy(), cg.graphify(Branchy())
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4)
            assert torch.equal(g(x, Slotted("a")), m(x, Slotted("a")))
    assert cg.stats(g).replays == 2  # (the first call captures, the next two replay)
