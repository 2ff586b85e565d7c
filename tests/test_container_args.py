"""A forward that changes a list or dict it is passed (a cache grown by ``kv[0] = torch.cat``,
``state["acc"] = ...``) does on every call what a replay, which runs no Python, would not:
such a signature runs eagerly with the reason. Found by a review (helper-18) as a silent wrong
result: the replays neither grew nor updated the caller's container. CPU double, compared
with an eager twin bitwise, outputs and containers."""

from __future__ import annotations

import copy

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._first_call import _container_marks, _containers_changed
from test_review_static_state import _quiet  # noqa: F401 (autouse: no grad, no warnings)


class _Accumulates(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, state):
        state["acc"] = state["acc"] + self.lin(x)
        return state["acc"] * 2


class _Grows(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, kv):
        kv[0] = torch.cat([kv[0], self.lin(x)], 1)
        return kv[0].sum(1)


class _Reads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, parts):
        return self.lin(x) + parts[0] * parts[1]["w"]


def _pair(cls):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref))


def test_a_dict_argument_changed_by_forward_runs_eagerly(sim):
    ref, g = _pair(_Accumulates)
    rs, gs = {"acc": torch.zeros(2, 4)}, {"acc": torch.zeros(2, 4)}
    for _ in range(5):
        x = torch.randn(2, 4)
        assert torch.equal(g(x, gs), ref(x, rs)) and torch.equal(gs["acc"], rs["acc"])
    s = cg.stats(g)
    assert s.captures == 0 and s.eager == 5, s
    assert "forward changes a list or dict it is passed" in next(iter(s.eager_calls))


def test_a_list_grown_by_forward_runs_eagerly_in_every_sequence(sim):
    ref, g = _pair(_Grows)
    for _ in range(2):  # (a second sequence sees the first one's shapes again)
        rk, gk = [torch.zeros(1, 0, 4)], [torch.zeros(1, 0, 4)]
        for _ in range(4):
            x = torch.randn(1, 1, 4)
            assert torch.equal(g(x, gk), ref(x, rk)) and torch.equal(gk[0], rk[0])
    assert cg.stats(g).captures == 0


def test_containers_only_read_are_graphed(sim):
    ref, g = _pair(_Reads)
    parts = [torch.randn(2, 4), {"w": torch.randn(2, 4)}]
    for _ in range(4):
        x = torch.randn(2, 4)
        assert torch.equal(g(x, parts), ref(x, parts))
    s = cg.stats(g)
    assert (s.captures, s.replays, s.eager) == (1, 3, 0), s


def test_the_marks_see_replaced_added_and_removed_items_nested():
    t, u = torch.zeros(1), torch.zeros(1)
    inner = {"k": t}
    args = ((inner, [t]), "not a container", t)
    marks = _container_marks(args)
    assert not _containers_changed(marks)
    inner["k"] = u  # an equal tensor, another object: changed
    assert _containers_changed(marks)
    inner["k"] = t
    assert not _containers_changed(marks)
    args[0][1].append(u)
    assert _containers_changed(marks)
    args[0][1].pop()
    del inner["k"]
    assert _containers_changed(marks)
