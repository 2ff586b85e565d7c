"""Segments: a replayed member call is matched against its record by a check compiled once per
call (cudagraphify._segcalls._Matcher). Every kind of argument it writes code for must see a
change: a value the forward computes from the data (after a host sync, so no guard of the
signature sees it) selects the arguments of the calls after it. CPU, simulated backend, bitwise
against an eager twin, the divergences counted."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg
from cudagraphify import _segrun


class _Args(nn.Module):
    """After a host sync, mode ``v`` (read from the input) changes one argument of one call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        v = int(x[0, 0].item())  # a host sync: the calls below form one segment
        h = self.lin(x)
        h = F.layer_norm(h, (8,) if v != 1 else [8], eps=1e-3 if v == 2 else 1e-5)
        h = torch.cat([h, h * 2.0], dim=0 if v == 3 else -1)
        h = h * (-0.0 if v == 4 else 0.0) + h
        h = h[:, 1:5] if v == 5 else h[:, 1:9]
        h = h.sum(dim=1, keepdim=v == 6) if v in (6, 7) else h + 1
        h = torch.clamp(h, -3.0, max=None if v == 8 else 3.0)
        return h * (float("nan") if v == 9 else 1.0) if v != 10 else h.to(torch.float64)


def _input(v: int) -> torch.Tensor:
    x = torch.randn(4, 8)
    x[0, 0] = v + 0.5
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return torch.equal(a.view(view), b.view(view))  # (-0.0 against 0.0, NaNs: their bits)


@pytest.mark.parametrize("v", range(1, 11))
def test_every_kind_of_argument_a_member_gets_is_matched(segments, v):
    torch.manual_seed(0)
    m = _Args().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = cg.graphify(copy.deepcopy(m))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):  # probe, record, two replays
            x = _input(0)
            assert _same_bits(g(x), m(x))
        (plan,) = g._cudagraphify_state.segments.plans()
        assert plan.divergences == 0 and plan.replays == 2 and len(plan.segments) == 1
        x = _input(v)
        assert _same_bits(g(x), m(x))
        assert plan.divergences == 1, v  # the changed argument was seen
        x = _input(0)
        assert _same_bits(g(x), m(x))
        assert plan.divergences == 1 and plan.replays == 4  # and the record still applies


class _Sources(nn.Module):
    """Hands a member a parameter, another tensor, or an earlier member's output of this call,
    as mode ``v`` says."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.other = nn.Parameter(torch.randn(8, 8))

    def forward(self, x, y):
        v = int(x[0, 0].item())
        h = x @ self.w
        k = h.relu()
        w = self.other if v == 1 else self.w
        src = y if v == 2 else k
        return (src @ w + 1).tanh()


@pytest.mark.parametrize("v", [1, 2])
def test_a_tensor_from_another_source_is_seen(segments, v):
    torch.manual_seed(0)
    m = _Sources().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = cg.graphify(copy.deepcopy(m))
    y = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            x = _input(0)
            assert torch.equal(g(x, y), m(x, y))
        (plan,) = g._cudagraphify_state.segments.plans()
        assert plan.divergences == 0 and plan.replays == 2
        x = _input(v)
        assert torch.equal(g(x, y), m(x, y))
        assert plan.divergences == 1


class _Timed(nn.Module):
    """A host sync between two runs of calls; each forward advances the test's clock by what
    it is told the segments' run, or the run without them, costs."""

    cost = {True: 1.0, False: 1.0}  # under the segments' mode -> seconds

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        _NOW[0] += self.cost[torch._C._len_torch_function_stack() > 0]
        h = self.a(x).relu()
        if h.sum().item() > 1e9:
            h = h * 0
        return self.b(h).tanh()


_NOW = [0.0]


@pytest.mark.parametrize("segments_cost, kept", [(1.0, True), (2.0, False)])
def test_segments_that_do_not_pay_are_given_back(segments, segments_cost, kept):
    segments.clock = lambda device: lambda: _NOW[0]
    torch.manual_seed(0)
    m = _Timed().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = cg.graphify(copy.deepcopy(m))
    g.cost = {True: segments_cost, False: 1.0}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # probe, record
            x = torch.randn(4, 8)
            assert torch.equal(g(x), m(x))
        (plan,) = g._cudagraphify_state.segments.plans()
        assert plan.trial is not None
        calls = 0
        while plan.trial is not None and calls < 40:  # segments and the forward without them
            x = torch.randn(4, 8)
            assert torch.equal(g(x), m(x))
            calls += 1
        # (the pieces' own first calls, their captures and timings, ran in the forward without
        # segments: those timings were voided, and taken again once the pieces had settled)
        assert plan.trial is None and plan.voided > 0, (calls, plan.voided)
        assert plan.replays == 2 * 3  # (three timed calls with segments, two segments each)
        assert (plan.given_back is None) == kept, plan.given_back
        for _ in range(3):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), m(x))
    assert plan.replays == 2 * (6 if kept else 3)
    assert (cg.stats(g).segments > 0) == kept
    text = str(cg.explain(g))
    if kept:
        assert "segments: timed on its first calls: 1000000 µs a call with segments, " \
            "1000000 µs without: kept" in text, text
    else:
        assert "segments given back: they cost more" in plan.given_back
        assert "segments: segments given back: they cost more than the forward without them " \
            "(2000000 vs 1000000 µs a call" in text, text
    # each boundary with the line of the forward that made it
    line = _Timed.forward.__code__.co_firstlineno + 3
    assert f"Tensor.item at tests/test_segments_match.py:{line}: eager (refused by the " \
        "policy (HOST_SYNC))" in text, text


def test_the_segments_option_turns_them_on_for_one_callable(sim):
    torch.manual_seed(0)
    m = _Args().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on, off = cg.graphify(copy.deepcopy(m), segments=True), cg.graphify(copy.deepcopy(m))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            x = _input(0)
            want = m(x)
            assert _same_bits(on(x), want) and _same_bits(off(x), want)
    assert cg.stats(on).segments == 1 and cg.stats(on).segment_replays == 2
    assert cg.stats(off).segments == 0
    with pytest.raises(cg.CudagraphifyUsageError, match="segments must be True or False"):
        cg.graphify(copy.deepcopy(m), segments="yes")


def test_a_kv_cache_that_grows_every_step_leaves_its_calls_eager_and_graphs_the_rest(sim):
    # HF generate() with its DynamicCache: an argument no signature holds, a cat that grows
    # every step. The calls whose arguments change between two records run eagerly, in
    # segments of their own (the cache's cat, the attention over it); the runs between them
    # are graphed
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=128)
    m = transformers.LlamaForCausalLM(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = cg.graphify(copy.deepcopy(m), segments=True)
    ids = torch.randint(0, 64, (1, 5))
    greedy = dict(max_new_tokens=16, do_sample=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = m.generate(ids, **greedy)
        for _ in range(2):
            assert torch.equal(g.generate(ids, **greedy), want)
    (plan,) = g._cudagraphify_state.segments.plans()
    refused = [seg.refused for seg in plan.segments]
    assert refused.count(_segrun.VARYING) >= 2 * 3  # per layer: two cats and the attention
    assert any(r is None for r in refused) and plan.replays > 20
    grown = [plan.calls[seg.first].name for seg in plan.segments if seg.refused == _segrun.VARYING]
    assert grown.count("torch.cat") == 4 and grown.count("F.scaled_dot_product_attention") == 2


class _Phased(nn.Module):
    """Takes one of two paths, as the sign of its input's sum says (read on the host)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x).relu()
        if x.sum().item() > 0:
            return self.b(h).tanh() + 1
        return self.b(h).sigmoid() * 2


def test_a_plan_that_served_gives_the_budget_of_records_back(segments):
    # a generate() whose prefill and decode steps, or phases of a workload, take turns: each
    # switch drops the plan and records again; plans that served many calls do not use up the
    # signature's budget (MAX_PLANS records in a row that never served)
    torch.manual_seed(0)
    m = _Phased().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = cg.graphify(copy.deepcopy(m), segments=True)
    item = None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for phase in range(2 * _segrun.MAX_PLANS + 2):
            sign = 1.0 if phase % 2 == 0 else -1.0
            for _ in range(_segrun.PAID + 6):
                x = torch.rand(4, 8) * sign
                assert torch.equal(g(x), m(x))
            (item,) = g._cudagraphify_state.segments._plans.values()
    plan = item[1]
    assert plan is not None and plan.matched >= _segrun.PAID  # the last phase still replays
