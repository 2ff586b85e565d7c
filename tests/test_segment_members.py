"""Segments' module members (cudagraphify._segrun, experimental): a graphed submodule (a piece)
met inside a segment whose calls are all members of it is answered whole at its call, its
Python not run. CPU tests on the simulated backend, which replays the recorded aten ops on the
captured memory (a stale replay shows as a wrong value); every output is compared with eager's
twin, and the counters show which path answered."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify.bench.models import GPT


def _graphed(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cg.graphify(copy.deepcopy(m))


def _calls(g, m, *inputs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in inputs:
            got, want = g(x), m(x)
            assert torch.equal(got, want), (got - want).abs().max()


def _plan(g):
    (plan,) = g._cudagraphify_state.segments.plans()
    return plan


def _members(plan) -> list[str]:
    return [type(m.module).__name__ for ms in plan.members.values() for m in ms]


def test_a_blocks_submodules_are_answered_whole(segments):
    torch.manual_seed(0)
    m = GPT(32, 4, 2, sync="item").eval()
    g = _graphed(m)
    _calls(g, m, *[torch.randn(2, 5, 32) for _ in range(5)])
    plan = _plan(g)
    # (per block: ln1, attn, ln2, mlp; then ln_f)
    assert sorted(_members(plan)) == sorted(["LayerNorm", "Attention", "LayerNorm", "MLP"] * 2
                                            + ["LayerNorm"])
    # the first call decides, the second records, three replay: every member answered whole
    assert plan.whole == 3 * 9 and plan.divergences == 0


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 2.0
        self.act = True

    def forward(self, x):
        h = self.lin(x) * self.scale
        return h.relu() if self.act else h.neg()


class _Root(nn.Module):
    """A host sync between two graphed submodules."""

    def __init__(self):
        super().__init__()
        self.a = _Scaled()
        self.b = _Scaled()

    def forward(self, x):
        h = self.a(x) + 1
        if h.sum().item() > -1e9:
            h = h * 3
        return self.b(h) - 1


def test_an_attribute_a_member_reads_changed_after_the_record(segments):
    torch.manual_seed(0)
    m = _Root().eval()
    g = _graphed(m)
    x = torch.randn(3, 8)
    _calls(g, m, x, x, x)
    assert sorted(_members(_plan(g))) == ["_Scaled", "_Scaled"]
    for mod in (m, g):
        mod.b.scale = 5.0
        mod.a.act = False
    _calls(g, m, x, x, x, x)


class _SetsBefore(_Root):
    """Sets what a member reads inside the forward, from data, before calling it."""

    def forward(self, x):
        h = self.a(x) + 1
        self.b.scale = 2.0 if h.sum().item() > 0 else 4.0
        return self.b(h) - 1


def test_an_attribute_the_forward_sets_before_a_member(segments):
    torch.manual_seed(0)
    m = _SetsBefore().eval()
    g = _graphed(m)
    pos, neg = torch.ones(3, 8), -torch.ones(3, 8) * 50
    _calls(g, m, pos, pos, pos, neg, pos, neg, neg, pos)


def test_a_hook_registered_on_an_inner_module_after_the_record_runs(segments):
    torch.manual_seed(0)
    m = _Root().eval()
    g = _graphed(m)
    x = torch.randn(3, 8)
    _calls(g, m, x, x, x)
    plan = _plan(g)
    whole = plan.whole
    assert whole > 0
    seen = []
    for mod in (m, g):
        mod.b.lin.register_forward_hook(lambda mod, args, out: seen.append(1) or out * 2)
    _calls(g, m, x, x)
    assert len(seen) == 4  # (two calls of each twin: the hook ran on every call)


def test_a_forward_replaced_on_an_inner_module_runs(segments):
    torch.manual_seed(0)
    m = _Root().eval()
    g = _graphed(m)
    x = torch.randn(3, 8)
    _calls(g, m, x, x, x)
    for mod in (m, g):
        lin = mod.b.lin
        lin.forward = lambda t, lin=lin: torch.nn.functional.linear(t, lin.weight) * 7
    _calls(g, m, x, x)


class _Leaks(nn.Module):
    """Keeps an intermediate of its calls, which its parent reads later."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.kept = None

    def forward(self, x):
        h = self.lin(x)
        self.kept = h * 2
        return h.relu()


class _ReadsKept(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _Leaks()
        self.b = _Scaled()

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > -1e9:
            h = h + self.a.kept
        return self.b(h)


def test_a_module_whose_intermediate_is_read_later_is_not_answered_whole(segments):
    torch.manual_seed(0)
    m = _ReadsKept().eval()
    g = _graphed(m)
    _calls(g, m, *[torch.randn(3, 8) for _ in range(5)])
    for plan in g._cudagraphify_state.segments.plans():
        assert "_Leaks" not in _members(plan)


class _OwnTensor(nn.Module):
    """Reads a plain tensor attribute (not a buffer): copied in by each call that reads it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.offset = torch.zeros(8)

    def forward(self, x):
        return self.lin(x) + self.offset


class _RootOwn(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _OwnTensor()
        self.b = _Scaled()

    def forward(self, x):
        h = self.a(x).relu()
        if h.sum().item() > -1e9:
            h = h * 2
        return self.b(h)


def test_a_tensor_attribute_changed_in_place_is_read_again(segments):
    torch.manual_seed(0)
    m = _RootOwn().eval()
    g = _graphed(m)
    x = torch.randn(3, 8)
    _calls(g, m, x, x, x)
    for plan in g._cudagraphify_state.segments.plans():
        assert "_OwnTensor" not in _members(plan)  # (it reads a tensor not its argument)
    for mod in (m, g):
        mod.a.offset.fill_(3.0)
    _calls(g, m, x, x)


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.lin(x) * 2 + y


class _RootPair(nn.Module):
    def __init__(self, same: bool):
        super().__init__()
        self.p = _Pair()
        self.same = same

    def forward(self, x):
        h = x.relu()
        out = self.p(h, h) if self.same else self.p(h, h * 2)
        if out.sum().item() > -1e9:
            out = out + 1
        return self.p(out, out.neg())


def test_the_same_tensor_passed_twice_is_not_answered_whole(segments):
    torch.manual_seed(0)
    m = _RootPair(same=True).eval()
    g = _graphed(m)
    _calls(g, m, *[torch.randn(3, 8) for _ in range(4)])
    plan = _plan(g)
    assert [(mm.start, type(mm.module).__name__) for ms in plan.members.values()
            for mm in ms] == [(max(plan.members), "_Pair")]  # (only the second call)


class _WithInt(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, n: int):
        return self.lin(x) * n


class _RootInt(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = _WithInt()
        self.n = 2

    def forward(self, x):
        h = self.w(x.relu(), self.n)
        if h.sum().item() > -1e9:
            h = h + 1
        return h * 2


def test_a_member_called_with_another_value_runs_its_calls(segments):
    torch.manual_seed(0)
    m = _RootInt().eval()
    g = _graphed(m)
    x = torch.randn(3, 8)
    _calls(g, m, x, x, x)
    assert _members(_plan(g)) == ["_WithInt"]
    for mod in (m, g):
        mod.n = 3
    _calls(g, m, x, x, x)


class _ReadsArgAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * getattr(x, "scale", 1.0)


class _RootAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.r = _ReadsArgAttr()

    def forward(self, x):
        h = x.relu()
        h = h * 1 if h.sum().item() > -1e9 else h
        return self.r(h) + 1


def test_an_argument_that_carries_attributes_runs_the_members_calls(segments, monkeypatch):
    torch.manual_seed(0)
    m = _RootAttr().eval()
    g = _graphed(m)
    x = torch.randn(3, 8)
    _calls(g, m, x, x, x)
    plan = _plan(g)
    assert _members(plan) == ["_ReadsArgAttr"] and plan.whole > 0
    # the member's argument made by the forward carries an attribute from now on
    real = torch.Tensor.mul

    def tagged(self, other):
        out = real(self, other)
        if other == 1:
            out.scale = 4.0
        return out

    monkeypatch.setattr(torch.Tensor, "__mul__", tagged)
    _calls(g, m, x, x)


def test_explain_counts_the_members(segments):
    torch.manual_seed(0)
    m = _Root().eval()
    g = _graphed(m)
    x = torch.randn(3, 8)
    _calls(g, m, x, x, x)
    text = "\n".join(_plan(g).describe())
    assert "module calls answered whole (their Python not run), 2 so far: _Scaled at call 0, " \
        "_Scaled at call" in text


def test_a_piece_given_back_for_good_is_still_answered_whole(segments):
    """With segments on, a piece given back keeps its DirectCall (no PlainCall put in its
    place, which no segments' replay would meet)."""
    import weakref

    from cudagraphify import _wrap

    torch.manual_seed(0)
    m = _Root().eval()
    g = _graphed(m)
    x = torch.randn(3, 8)
    _calls(g, m, x, x, x)
    plan = _plan(g)
    whole = plan.whole
    _wrap._retire_piece(weakref.ref(g.b))
    assert not isinstance(g.b.__dict__["_compiled_call_impl"], cg._watch.PlainCall)
    _calls(g, m, x, x)
    assert plan.whole == whole + 4
