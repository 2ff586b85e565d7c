"""GPU review of 203172a (segments' per-call replay path made leaner: a member module call's lone
output handed without the structure walk, the flush after a segment's launch only where one is
pending, no copy loop without copies, the calls' bound read once, ``held()`` as list compares).
Plain python; prints ``PASS name`` / ``FAIL name`` and ``SUMMARY k/n``.

``finding*`` checks assert eager's behaviour: they FAIL while the finding stands (strict xfails
in tests/test_review_segpath.py; finding1 is pre-existing, 203172a~1 as well, and fixed since: its
checks PASS); ``control*``
checks should PASS. Every result is compared with an eager twin (``copy.deepcopy`` before
graphify) with ``torch.equal``, also after later calls (on the GPU the graphs' memory is really
reused), and counters show the segments path ran (segment replays, module calls answered
whole, no divergence where none is meant).

Segments are on (``graphify(m, segments=True)``) and their trial is off
(``CudaBackend.clock = None``, as tests/conftest.py does): never given back by time.

Run from the repository root: ``PYTHONPATH=. python .ci/review/segpath/gpu_segpath.py`` (a few
seconds on an H100); ``CG_REVIEW_SIM=1`` runs the same logic on the CPU double.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback
import warnings

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture, _segcalls, _segmodes, _segrun

warnings.simplefilter("ignore")
SIM = os.environ.get("CG_REVIEW_SIM") == "1"
DEV = "cpu" if SIM else "cuda"
if SIM:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
    from conftest import SimBackend
    _BACKEND = SimBackend()
    _capture.set_backend(_BACKEND)
    torch.cuda.is_current_stream_capturing = lambda: _BACKEND.capturing
elif not torch.cuda.is_available():
    print("SKIP: no CUDA device (CG_REVIEW_SIM=1 runs the CPU double)")
    sys.exit(0)
_capture.CudaBackend.clock = None  # (no trial: segments never given back by time)

T0 = time.perf_counter()
D = 8
N = 6  # calls per scenario: 1 decides, 2 records, 3+ replay
RESULTS: list[tuple[str, bool]] = []


def sync():
    if not SIM:
        torch.cuda.synchronize()


def check(name, *params):
    def deco(fn):
        for p in params or (None,):
            full = name if p is None else f"{name}[{p}]"
            try:
                fn() if p is None else fn(p)
                sync()
                ok = True
            except Exception as e:  # noqa: BLE001
                ok = False
                msg = "".join(traceback.format_exception_only(type(e), e)).strip()
                print(f"  ({full}: {msg[:300]})", flush=True)
            finally:
                STORE.clear()
                _segcalls._own_codes.pop(_peek.__code__, None)
                _FLIP[0] = False
            RESULTS.append((full, ok))
            print(("PASS " if ok else "FAIL ") + full, flush=True)
        return fn
    return deco


# -- counters ---------------------------------------------------------------------------------

WHOLE: list = []  # module calls answered whole (any plan)
HELD: list = []  # what SegmentPlan.held answered
_real_whole, _real_held = _segmodes._Run.whole, _segrun.SegmentPlan.held


def _whole(self, member, args, kwargs):
    out = _real_whole(self, member, args, kwargs)
    if out is not _segmodes._NO:
        WHOLE.append(member)
    return out


def _held(self):
    HELD.append(_real_held(self))
    return HELD[-1]


_segmodes._Run.whole = _whole
_segrun.SegmentPlan.held = _held


# -- helpers ----------------------------------------------------------------------------------

def twins(m):
    torch.manual_seed(0)
    m = m.to(DEV).eval()
    g = cg.graphify(copy.deepcopy(m), segments=True)
    WHOLE.clear()
    HELD.clear()
    return g, m


def plan_of(g):
    (plan,) = g._cudagraphify_state.segments.plans()
    return plan


def leaves(o):
    if isinstance(o, torch.Tensor):
        return [o]
    if isinstance(o, (list, tuple)):
        return [t for v in o for t in leaves(v)]
    return []


def same(a, b):
    la, lb = leaves(a), leaves(b)
    assert type(a) is type(b) and len(la) == len(lb), (type(a), type(b))
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), \
            f"differs from eager by {(x.double() - y.double()).abs().max().item()}"


def inputs(n=N, two=False, seed=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    xs = [torch.randn(3, D, generator=gen, device=DEV) for _ in range(n)]
    if not two:
        return [(x,) for x in xs]
    return [(x, torch.randn(3, D, generator=gen, device=DEV)) for x in xs]


def run(g, m, ins, post=None):
    outs = []
    with torch.no_grad():
        for i, args in enumerate(ins):
            got, want = g(*args), m(*args)
            sync()
            same(got, want)
            if post is not None:
                post(i, g, got, m, want)
            outs.append((got, want))
    for got, want in outs:  # (after every later call's replay)
        same(got, want)
    return outs


def replays(g):
    return cg.stats(g).segment_replays


def ran(g, whole=True, diverged=0, at_least=N - 2):
    plan = plan_of(g)
    assert replays(g) >= at_least, f"segment replays {replays(g)} < {at_least}"
    if whole:
        assert plan.whole >= N - 2, f"answered whole {plan.whole}"
    assert plan.divergences == diverged, f"divergences {plan.divergences}"
    return plan


def lone_members(g):
    return [m for ms in plan_of(g).members.values() for m in ms if m.lone is not None]


# -- modules ----------------------------------------------------------------------------------

class Elem(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return x * self.w + 0.5


class Host(nn.Module):
    """``body(self, h, *rest)`` after a host sync: its calls one graphed segment."""

    def __init__(self, body, **mods):
        super().__init__()
        self.inner = Elem()
        self.other = Elem()
        for k, v in mods.items():
            setattr(self, k, v)
        self.body = body

    def forward(self, x, *rest):
        h = x.relu()
        if h.sum().item() < -1e9:
            h = -h
        return self.body(self, h, *rest)


class ChunkOne(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.how = how

    def forward(self, x):
        h = x * self.w
        if self.how == "chunk":
            return h.chunk(1, dim=0)[0]
        if self.how == "unbind":
            return h.unsqueeze(0).unbind(0)[0]
        return h.split(D // 2, dim=1)[1]


class TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        h = x * self.w
        a, b = h.split(D // 2, dim=1)
        return b, a.exp()


class ParamView(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x):
        _ = x * 2
        return self.w.t()


class ViewOf(nn.Module):
    def forward(self, x):
        return (x * 2).t()


class SameOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return (x * self.w).float()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Elem()

    def forward(self, x):
        return self.inner(x)


_GLOBAL = torch.full((D,), 0.5, device=DEV)


class OuterReadsGlobal(Outer):
    def forward(self, x):
        return self.inner(x) + _GLOBAL


class ReadsY(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        a = x * self.w
        b = a + y
        return b.tanh() * 2


class EndsWithY(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        return (x * self.w).exp() + y


_PEEKED: list = []
_FLIP = [False]
STORE: dict = {}


def _peek(t):
    return t.sum()


class Flip(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Elem()

    def forward(self, x, y):
        h = x.relu()
        h = h * 1 if h.sum().item() > -1e9 else h
        a = self.inner(h)
        a = a.cos() if _FLIP[0] else a.sin()
        return a * 2 + y


class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Elem()

    def forward(self, x):
        h = x.relu()
        n = 2 if h.sum().item() < 10 else 3
        for _ in range(n):
            h = self.inner(h).tanh()
        return h


class Keeps(nn.Module):
    def __init__(self, keep):
        super().__init__()
        self.inner = Elem()
        self.keep = keep
        self.key = "?"

    def forward(self, x):
        h = x.relu()
        if h.sum().item() < -1e9:
            h = -h
        a = self.inner(h)
        b = a.exp()
        box = STORE.setdefault(self.key, {"n": 0, "kept": None})
        box["n"] += 1
        kept = self.keep(box["n"], a, b)
        if kept is not False:
            box["kept"] = kept
        return b.sum(1)


class PrevStorage(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Elem()
        self.key = "?"

    def forward(self, x):
        h = x.relu()
        if h.sum().item() < -1e9:
            h = -h
        a = self.inner(h)
        out = a.exp().sum(1)
        prev = STORE.get(self.key)
        STORE[self.key] = (a.untyped_storage(), a.shape)
        if prev is not None:
            out = out + torch.empty(0, device=DEV).set_(prev[0], 0, prev[1]).sum(1)
        return out


def value(k):
    if isinstance(k, tuple):
        return torch.empty(0, device=DEV).set_(k[0], 0, k[1]).clone()
    return k


# -- findings ---------------------------------------------------------------------------------

@check("finding1_kept_storage_read_next_call")
def _():
    g, m = twins(PrevStorage())
    g.key, m.key = "g", "m"
    run(g, m, inputs())
    # (replayed, then held() saw the kept storage: the plan recorded again, its count anew)
    assert WHOLE and True in HELD


_STORAGE_KEEPS = {
    "untyped": lambda n, a, b: (a.untyped_storage(), a.shape),
    "typed": lambda n, a, b: (a.storage()._untyped_storage, a.shape),
}


@check("finding1_kept_storage_as_eager_left_it", *_STORAGE_KEEPS)
def _(keep):
    g, m = twins(Keeps(_STORAGE_KEEPS[keep]))
    g.key, m.key = "g", "m"
    history = []
    run(g, m, inputs(8), post=lambda i, g, got, m, want: history.append(
        (STORE["g"]["kept"], STORE["m"]["kept"], value(STORE["g"]["kept"]).clone())))
    # (replayed, then held() saw the kept storage: the plan recorded again, its count anew)
    assert WHOLE and True in HELD
    for kg, km, then in history:
        same(value(kg), then)
        same(value(kg), value(km))


# -- controls: lone members -------------------------------------------------------------------

@check("control_lone_member_read_by_a_later_call")
def _():
    g, m = twins(Host(lambda s, h: (s.inner(h) * 2).tanh() + s.other(h)))
    run(g, m, inputs())
    ran(g)
    assert len(lone_members(g)) == 2


@check("control_lone_member_returned_and_written")
def _():
    def post(i, g, got, m, want):
        got.add_(1)
        want.add_(1)
        same(got, want)
    g, m = twins(Host(lambda s, h: s.inner(h * 3)))
    run(g, m, inputs(), post=post)
    ran(g)
    assert lone_members(g)


@check("control_lone_member_read_twice_and_returned_twice")
def _():
    def body(s, h):
        a = s.inner(h * 3)
        return a, a + 1, a.sum(0), a
    g, m = twins(Host(body))
    outs = run(g, m, inputs())
    ran(g)
    for got, want in outs:
        assert (got[0] is got[3]) == (want[0] is want[3])


@check("control_member_returning_one_tensor_of_a_tuple_call", "chunk", "unbind", "split")
def _(how):
    def post(i, g, got, m, want):
        got[1].add_(1)
        want[1].add_(1)
        same(got, want)
    g, m = twins(Host(lambda s, h: (s.c(h + 1), s.c(h + 1) * 2, h.clone()), c=ChunkOne(how)))
    run(g, m, inputs(), post=post)
    ran(g)
    assert bool(lone_members(g)) == (how != "split")


@check("control_member_with_two_outputs_read_later")
def _():
    def body(s, h):
        b, a = s.t(h)
        return torch.cat([a, b], 1) * s.inner(h)
    g, m = twins(Host(body, t=TwoOut()))
    run(g, m, inputs())
    plan = ran(g)
    assert any(mb.lone is None for ms in plan.members.values() for mb in ms)


@check("control_lone_member_returning_a_view_of_a_parameter")
def _():
    def body(s, h):
        v = s.p(h)
        return v, h @ v

    def post(i, g, got, m, want):
        assert got[0].data_ptr() == g.p.w.data_ptr()
        got[0].add_(0.25)
        want[0].add_(0.25)
        same(got, want)
        same(g.p.w.detach(), m.p.w.detach())
    g, m = twins(Host(body, p=ParamView()))
    run(g, m, inputs(), post=post)
    ran(g, whole=False, at_least=1)


@check("control_lone_member_returning_a_view_of_another_members_output")
def _():
    def body(s, h):
        a = s.inner(h)
        v = s.v(a)
        return a, v, v.sum(1)

    def post(i, g, got, m, want):
        got[0].add_(1)
        want[0].add_(1)
        same(got, want)
    g, m = twins(Host(body, v=ViewOf()))
    run(g, m, inputs(), post=post)
    ran(g)


@check("control_member_returning_an_output_as_is_not_whole")
def _():
    g, m = twins(Host(lambda s, h: s.f(h) + s.inner(h), f=SameOut()))
    run(g, m, inputs())
    plan = ran(g)
    assert not any(type(mb.module) is SameOut for ms in plan.members.values() for mb in ms)


@check("control_nested_lone_members", "Outer", "OuterReadsGlobal")
def _(which):
    outer = Outer if which == "Outer" else OuterReadsGlobal
    g, m = twins(Host(lambda s, h: s.o(h * 2) * 3, o=outer()))
    run(g, m, inputs())
    plan = ran(g)
    names = {type(mb.module).__name__ for ms in plan.members.values() for mb in ms}
    assert names == ({"Outer"} if outer is Outer else {"Elem"}), names


# -- controls: the flush after the launch -----------------------------------------------------

def last_graphed(g):
    plan = plan_of(g)
    return plan, [s for s in plan.segments if s.graph is not None][-1]


@check("control_member_spanning_the_launch", "first", "middle")
def _(where):
    if where == "first":
        body = lambda s, h, y: s.r(h, y) + 1  # noqa: E731
    else:
        body = lambda s, h, y: s.r(s.inner(h), y) + 1  # noqa: E731
    g, m = twins(Host(body, r=ReadsY()))
    run(g, m, inputs(two=True))
    plan, sg = last_graphed(g)
    (member,) = [mb for ms in plan.members.values() for mb in ms if type(mb.module) is ReadsY]
    assert member.start <= sg.launch < member.end
    assert (member.start == sg.first) == (where == "first")
    ran(g)


@check("control_member_before_the_launch")
def _():
    g, m = twins(Host(lambda s, h, y: (s.inner(h) + y).relu() * 3))
    run(g, m, inputs(two=True))
    plan, sg = last_graphed(g)
    (member,) = [mb for ms in plan.members.values() for mb in ms]
    assert member.start == sg.first and member.end <= sg.launch
    ran(g)


@check("control_launch_is_the_segments_last_call", "call", "member")
def _(how):
    if how == "call":
        body = lambda s, h, y: s.inner(h).sin() + y  # noqa: E731
    else:
        body = lambda s, h, y: s.e(s.inner(h), y)  # noqa: E731
    g, m = twins(Host(body, e=EndsWithY()))
    run(g, m, inputs(two=True))
    plan, sg = last_graphed(g)
    assert sg.launch == sg.last
    ran(g)


@check("control_own_call_flushes_early_then_pends_again",
       "member_spanning", "member_before", "call")
def _(then):
    _segcalls._own_codes[_peek.__code__] = True
    _PEEKED.clear()

    def body(s, h, y):
        a = h * 3
        _PEEKED.append(_peek(a))
        if then == "member_spanning":
            return s.r(a, y) + 1
        if then == "member_before":
            return (s.inner(a) + y).relu()
        return (a + y).relu() * 2
    g, m = twins(Host(body, r=ReadsY()))
    ins = inputs(two=True)
    run(g, m, ins[:-1])
    before = replays(g)
    run(g, m, ins[-1:])
    assert replays(g) == before + 3, (replays(g), before)  # (first segment; peek; launch)
    assert torch.equal(_PEEKED[-1], _PEEKED[-2])
    ran(g, whole=then != "call")


@check("control_divergence_after_a_lone_member_before_the_launch")
def _():
    g, m = twins(Flip())
    ins = inputs(two=True)
    run(g, m, ins[:4])
    plan = plan_of(g)
    assert plan.whole > 0 and plan.divergences == 0
    _FLIP[0] = True
    run(g, m, ins[4:])
    assert plan.divergences > 0


@check("control_more_calls_than_recorded")
def _():
    g, m = twins(Loop())
    small = [(torch.full((3, D), 0.1, device=DEV) * (i + 1),) for i in range(4)]
    big = [(torch.full((3, D), 2.0, device=DEV) + i,) for i in range(2)]
    run(g, m, small)
    plan = plan_of(g)
    assert plan.whole > 0 and plan.divergences == 0
    run(g, m, big + small[:1])


# -- controls: held() -------------------------------------------------------------------------

_KEEPS = {
    "tensor": lambda n, a, b: a,
    "view": lambda n, a, b: a[1],
    "intermediate": lambda n, a, b: b,
    "every_other": lambda n, a, b: a if n % 2 else None,
    "once": lambda n, a, b: b if n == 4 else False,
}


@check("control_a_kept_output_is_not_overwritten", *_KEEPS)
def _(keep):
    g, m = twins(Keeps(_KEEPS[keep]))
    g.key, m.key = "g", "m"
    history = []

    def post(i, g, got, m, want):
        kg, km = STORE["g"]["kept"], STORE["m"]["kept"]
        history.append((kg, km, None if kg is None else kg.clone()))
        if kg is not None:
            same(kg, km)
    run(g, m, inputs(8), post=post)
    for kg, km, then in history:
        if then is not None:
            same(kg, km)
            same(kg, then)
    assert True in HELD and WHOLE


@check("control_held_lists_match_the_storages")
def _():
    g, m = twins(Host(lambda s, h: (s.inner(h) * 2).tanh() + s.other(h)))
    run(g, m, inputs())
    plan = plan_of(g)
    cdatas, counts, storages, ptrs, refs = plan._baselines
    assert len(cdatas) == len(counts) == len(storages) == len(ptrs) == len(refs) > 0
    assert not plan.held()
    extra = plan.calls[plan.segments[-1].last].outs[0].detach()
    assert plan.held()
    del extra
    assert not plan.held()


ok = sum(1 for _, good in RESULTS if good)
print(f"SUMMARY {ok}/{len(RESULTS)} ({'CPU double' if SIM else torch.cuda.get_device_name()}, "
      f"{time.perf_counter() - T0:.1f} s; finding* FAIL while the finding stands)")
