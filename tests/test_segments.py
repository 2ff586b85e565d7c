"""Segments (cudagraphify._segrun, experimental): the runs of safe calls inside an eager
signature's forward, graphed. CPU tests on the simulated backend, which replays the recorded
aten ops on the captured memory (a stale replay shows as a wrong value)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _segmodes, _segrun
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


@pytest.mark.parametrize("sync", ["item", "item-inline"])
def test_a_block_with_an_item_graphs_the_runs_between_them(segments, sync):
    torch.manual_seed(0)
    m = GPT(32, 4, 3, sync=sync).eval()
    g = _graphed(m)
    _calls(g, m, *[torch.randn(2, 5, 32) for _ in range(4)])
    s = cg.stats(g)
    assert s.segments == 4  # three .item() calls cut the forward in four
    # the first call is probed (it decides the signature), the second recorded, then replays
    assert s.segment_replays == 2 * 4
    plan = _plan(g)
    assert plan.divergences == 0
    assert sorted(plan.boundaries.values()) == ["refused by the policy (HOST_SYNC)"] * 3


class _Branchy(nn.Module):
    """Its second half depends on a value read on the host, and on an attribute."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        h = self.a(x).relu()
        if h.sum().item() > 0:
            return self.b(h) * self.scale + 1
        return self.b(h).neg() - 1


def test_a_call_that_goes_another_way_gives_eagers_result(segments):
    torch.manual_seed(0)
    m = _Branchy().eval()
    g = _graphed(m)
    pos = torch.ones(3, 8)
    _calls(g, m, pos, pos, pos)
    plan = _plan(g)
    assert plan.replays > 0 and plan.divergences == 0
    with torch.no_grad():  # a bias that makes h all zero: the other branch
        for mod in (m, g):
            mod.a.bias.fill_(-100.0)
    _calls(g, m, pos)
    assert plan.divergences == 1
    with torch.no_grad():
        for mod in (m, g):
            mod.a.bias.fill_(0.5)
    m.scale = g.scale = 3.0  # an attribute read by Python: a different constant argument
    _calls(g, m, pos, pos, pos, pos)
    # (the attribute's change made a new decision: a new entry, with a plan of its own; the
    # old entry's plan stays with it, for when the attribute is set back)
    plans = g._cudagraphify_state.segments.plans()
    assert len(plans) == 2 and plans[1].replays > 0 and plans[1].divergences == 0


def test_outputs_the_caller_keeps_are_not_overwritten(segments):
    torch.manual_seed(0)
    m = GPT(32, 4, 2, sync="item").eval()
    g = _graphed(m)
    xs = [torch.randn(2, 5, 32) for _ in range(4)]
    with torch.no_grad():
        kept = [g(x) for x in xs]
        for x, y in zip(xs, kept):
            assert torch.equal(y, m(x))
    assert cg.stats(g).segment_replays > 0


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x) + torch.rand_like(x)  # random: a graph would draw other numbers
        y = h.relu() * 2
        return y if y.sum().item() < 1e9 else y


def test_a_segment_whose_graph_differs_from_eager_runs_eagerly(segments):
    g = _graphed(_Noisy().eval())
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(2, 8))
    plan = _plan(g)
    assert plan.segments[0].refused and "differs from the eager call" in plan.segments[0].refused
    assert cg.stats(g).segments == 0


def test_a_parameter_replaced_or_a_flag_changed_records_again(segments):
    torch.manual_seed(0)
    m = _Branchy().eval()
    g = _graphed(m)
    x = torch.ones(3, 8)
    _calls(g, m, x, x)
    first = _plan(g)
    new = torch.randn(8, 8)
    with torch.no_grad():
        m.b.weight.data = new.clone()
        g.b.weight.data = new.clone()
    _calls(g, m, x, x, x)  # (an invalidation: probed again, recorded, replayed)
    second = _plan(g)
    assert second is not first and second.replays > 0
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        _calls(g, m, x)
    finally:
        torch.set_default_dtype(old)
    assert _plan(g) is not second


def test_off_by_default_and_grad_mode_runs_eagerly(sim):
    assert _segrun.ENABLED is False
    torch.manual_seed(0)
    m = GPT(32, 4, 2, sync="item").eval()
    g = _graphed(m)
    _calls(g, m, torch.randn(2, 5, 32), torch.randn(2, 5, 32))
    assert cg.stats(g).segments == 0


def test_an_input_read_through_a_view_is_copied_each_call(segments):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            v = x[:, :8]  # a view of the input: runs as it is, its reader copies it in
            h = self.lin(v).relu() * 3
            return h + 1 if h.sum().item() > -1e9 else h

    m = M().eval()
    g = _graphed(m)
    _calls(g, m, *[torch.randn(2, 12) for _ in range(4)])
    plan = _plan(g)
    assert plan.replays > 0 and plan.divergences == 0
    assert any("view of memory it reads" in why for why in plan.boundaries.values())


class _Evt:
    def __init__(self, name, parent=None):
        self.name, self.cpu_parent = name, parent


def test_a_launch_outside_every_recorded_call_is_found():
    call = _Evt(_segmodes._RANGE)
    op = _Evt("aten::mm", call)
    inside = [call, op, _Evt("cudaLaunchKernel", op), _Evt("cudaMemcpyAsync", call)]
    assert _segmodes.direct_launch(inside) is None
    assert _segmodes.direct_launch([_Evt("cudaDeviceSynchronize")]) is None
    why = _segmodes.direct_launch(inside + [_Evt("cuLaunchKernel", _Evt("triton_launcher"))])
    assert why is not None and why.startswith("cuLaunchKernel ran outside")


class _Box:
    """A plain object: the output copy does not look into it."""

    def __init__(self, t):
        self.t = t


def test_a_graph_output_kept_inside_an_object_is_not_overwritten(segments):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x).relu() * 2
            return _Box((h + 1) * 3) if h.sum().item() > -1e9 else None

    torch.manual_seed(0)
    m = M().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 8) for _ in range(6)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        boxes = [g(x) for x in xs]
        for x, box in zip(xs, boxes):
            assert torch.equal(box.t, m(x).t)


class _Splits(nn.Module):
    """A call with several outputs (``split``: a tuple) whose tuple the forward returns as it
    is, one of whose parts a later call reads, between two host syncs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > -1e9:
            x = x + 1
        parts = self.lin(x).split(4, dim=-1)
        y = parts[0] * parts[1] + 2
        z = (y * 3).relu()
        if z.abs().amax().item() >= 0:
            return parts, z
        return parts, -z


def test_a_calls_tuple_of_outputs_is_handed_as_a_tuple_of_this_calls_values(segments):
    torch.manual_seed(0)
    m = _Splits().eval()
    g = _graphed(m)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(5):
            x = torch.randn(3, 8) + k
            got, want = g(x), m(x)
            assert type(got[0]) is tuple and len(got[0]) == 2
            for a, b in zip(got[0], want[0]):
                assert torch.equal(a, b)
            assert torch.equal(got[1], want[1])
    plan = _plan(g)
    assert plan.replays > 0 and plan.divergences == 0
    split = next(c for c in plan.calls if c.name == "Tensor.split")
    assert split.segment is not None and split.flat is tuple
