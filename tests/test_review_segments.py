"""Review of segments (cudagraphify._segrun, experimental): adversarial CPU tests on the simulated
backend. The findings' tests (test_f*) failed before their fix; the others document attacks that
came out right.

Call counting (see _segrun): call 1 of a signature is probed, call 2 recorded, calls 3+ replay,
so every test makes at least 4 calls and compares each output with an eager deepcopy bitwise.
"""

from __future__ import annotations

import copy
import re
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg


@pytest.fixture
def segments(sim, segments_enabled):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield sim


def _graphed(m):
    return cg.graphify(copy.deepcopy(m))


def _plans(g):
    return g._cudagraphify_state.segments.plans()


def _same(a, b):
    """Bitwise equal (NaN equal to NaN), through tuples, lists and dicts."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and (
            torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all()))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _calls(g, m, inputs, grad=False):
    """Call both on each input (a tensor or a tuple of arguments); every output bitwise equal."""
    ctx = torch.enable_grad if grad else torch.no_grad
    with ctx():
        for n, x in enumerate(inputs):
            args = x if isinstance(x, tuple) else (x,)
            got, want = g(*args), m(*args)
            assert _same(got, want), f"call {n + 1}: {got} != {want}"


def _replayed(g):
    return sum(p.replays for p in _plans(g))


class _Lin2(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)


# =============================================================================================
# Findings (each failed before its fix)
# =============================================================================================


class _ClampKw(_Lin2):
    """A keyword argument that is an int on one path and a tensor on another."""

    def __init__(self):
        super().__init__()
        self.register_buffer("lo", torch.linspace(-1, 1, 8))

    def forward(self, x):
        h = self.a(x) * 2
        lo = 0 if x.sum().item() > 0 else self.lo  # a host-side branch
        return torch.clamp(h, min=lo) * 3 + 1


def test_f1_a_tensor_keyword_where_an_int_was_recorded_does_not_crash(segments):
    torch.manual_seed(0)
    m = _ClampKw().eval()
    g = _graphed(m)
    pos = torch.ones(2, 8)
    _calls(g, m, [pos, pos, pos, -pos, pos])


class _PreciseBN(nn.Module):
    """BatchNorm in train mode under no_grad (re-estimating BN statistics: "precise BN")."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.bn(self.lin(x)) * 2
        if h.sum().item() > 1e9:
            return h
        return h.relu() + 1


def test_f2_batchnorm_running_stats_in_train_mode_under_no_grad(segments):
    """F.batch_norm in training writes the running statistics without an in-place name: it was
    a member, and the capture's warm-up and verification updated them twice more. The record
    now compares each member's tensor arguments before and after the call."""
    torch.manual_seed(0)
    m = _PreciseBN().train()
    g = _graphed(m)
    xs = [torch.randn(4, 8) for _ in range(4)]
    _calls(g, m, xs)  # (outputs use batch statistics: equal)
    assert torch.equal(g.bn.running_mean, m.bn.running_mean)
    assert torch.equal(g.bn.running_var, m.bn.running_var)
    (plan,) = _plans(g)
    assert re.search(r"F\.batch_norm at \S+: eager \(writes a tensor argument in place",
                     "\n".join(plan.describe()))


def test_f2b_batchnorm_in_eval_mode_stays_a_member(segments):
    torch.manual_seed(0)
    m = _PreciseBN().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(4, 8) for _ in range(4)])
    (plan,) = _plans(g)
    assert [c.name for c in plan.calls if c.seg is not None][:2] == ["F.linear", "F.batch_norm"]
    assert plan.segments[0].graph is not None and plan.replays > 0


_PAUSE: dict = {}  # thread id -> event to wait for (a global: not guarded as module state)


class _Pausing(_Lin2):
    """Waits (in Python, between two members of one segment) where a test says so."""

    def forward(self, x):
        h = self.a(x).relu()
        ev = _PAUSE.get(threading.get_ident())
        if ev is not None:
            ev.wait(5)
        h = self.b(h) * 2
        return h + 1 if h.sum().item() > -1e9 else h


def test_f3_a_second_thread_does_not_release_a_plan_being_replayed(segments):
    torch.manual_seed(0)
    m = _Pausing().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 8) for _ in range(5)]
    _calls(g, m, xs[:3])
    (plan,) = _plans(g)
    ev = threading.Event()
    res: dict = {}

    def call(k, x):
        try:
            with torch.no_grad():
                res[k] = g(x)
        except Exception as e:  # noqa: BLE001
            res[k] = e

    t1 = threading.Thread(target=call, args=(1, xs[3]))
    orig = t1.run

    def run():
        _PAUSE[threading.get_ident()] = ev
        orig()

    t1.run = run
    try:
        t1.start()
        time.sleep(0.1)  # (thread 1 now waits inside its forward, aliases handed out)
        t2 = threading.Thread(target=call, args=(2, xs[4]))
        t2.start()
        deadline = time.time() + 2
        while plan.segments[0].graph is not None and time.time() < deadline:
            time.sleep(0.01)
        ev.set()
        t1.join(5)
        t2.join(5)
    finally:
        ev.set()
        _PAUSE.clear()
    with torch.no_grad():
        assert not isinstance(res[1], Exception), repr(res[1])
        assert torch.equal(res[1], m(xs[3])) and torch.equal(res[2], m(xs[4]))


class _Twice(_Lin2):
    def forward(self, x):
        h = self.a(x).relu() * 2
        if h.sum().item() < -1e9:
            h = -h
        y = (h + 1) * 3
        return y, y


def test_f4_a_tensor_returned_twice_stays_one_tensor(segments):
    """owned() cloned each output leaf on its own: a tensor returned twice came back as two."""
    torch.manual_seed(0)
    m = _Twice().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 8)
            (a1, a2), (b1, b2) = g(x), m(x)
            a1.add_(1)
            b1.add_(1)
            assert (a1 is a2) == (b1 is b2)
            assert torch.equal(a2, b2)


class _Views(_Lin2):
    def forward(self, x):
        h = self.a(x).relu() * 2
        if h.sum().item() < -1e9:
            h = -h
        y = (h + 1) * 3
        return y, y.view(-1), y[1], y.t(), (h * 2,)


def test_f4b_outputs_that_are_views_of_one_another_stay_views(segments):
    torch.manual_seed(0)
    m = _Views().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 8)
            got, want = g(x), m(x)
            assert _same(got, want)
            assert [t.stride() for t in got[:4]] == [t.stride() for t in want[:4]]
            got[0].add_(1)
            want[0].add_(1)
            assert _same(got, want)  # (each view sees the write)
    assert _replayed(g) > 0


class _SparseAdj(nn.Module):
    """A graph layer: the adjacency is a sparse COO tensor made in forward (GNN style)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("idx", torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]]))
        self.register_buffer("val", torch.ones(4))

    def forward(self, x):
        h = self.a(x).relu()
        adj = torch.sparse_coo_tensor(self.idx, self.val, (4, 4))
        h = torch.sparse.mm(adj, h) * 2
        return h + 1 if h.sum().item() > -1e9 else h


def test_f5_a_sparse_tensor_in_forward_does_not_crash_the_record(segments):
    """The recorder read untyped_storage() of every argument and output: a sparse tensor
    raised inside the mode. Calls that take or return one are now boundaries."""
    torch.manual_seed(0)
    m = _SparseAdj().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(4, 8) for _ in range(4)])


class _SparseOut(_SparseAdj):
    def forward(self, x):
        h = self.a(x).relu() * 2
        if h.sum().item() < -1e9:
            h = -h
        vals = h[0, :4] + 1  # a member's output (graph memory), inside a returned sparse tensor
        return torch.sparse_coo_tensor(self.idx, vals, (4, 4)), h * 3


def test_f5b_a_sparse_tensor_returned(segments):
    torch.manual_seed(0)
    m = _SparseOut().eval()
    g = _graphed(m)
    with torch.no_grad():
        outs = []
        for _ in range(5):
            x = torch.randn(4, 8)
            (a, h), (b, k) = g(x), m(x)
            assert torch.equal(a.to_dense(), b.to_dense()) and torch.equal(h, k)
            outs.append((a, b))
        for a, b in outs:  # (what was handed out is not overwritten by a later replay)
            assert torch.equal(a.to_dense(), b.to_dense())


_AMP = [False]


class _GlobalAmp(_Lin2):
    def forward(self, x):
        h = self.a(x).relu()
        if h.sum().item() < -1e9:
            h = -h
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_AMP[0]):  # a global switch
            y = self.b(h) * 2
        return y.float() + 1


def test_f6_autocast_entered_inside_the_forward_is_seen(segments):
    """A member was matched by function, arguments and sources only; a call recorded with
    autocast off replayed its fp32 graph under autocast. Each segment now keeps the global
    state its calls ran under; a member is matched only under it."""
    torch.manual_seed(0)
    m = _GlobalAmp().eval()
    g = _graphed(m)
    xs = [torch.randn(4, 8) for _ in range(5)]
    try:
        _calls(g, m, xs[:3])
        _AMP[0] = True
        _calls(g, m, xs[3:])
    finally:
        _AMP[0] = False


class _AmpMidSegment(_Lin2):
    def forward(self, x):
        h = self.a(x).relu()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_AMP[0]):  # no call between
            y = self.b(h) * 2
        y = y.float() + 1
        return y if y.sum().item() > -1e9 else y


def test_f6b_autocast_switched_between_two_calls_of_one_segment(segments):
    torch.manual_seed(0)
    m = _AmpMidSegment().eval()
    g = _graphed(m)
    xs = [torch.randn(4, 8) for _ in range(7)]
    try:
        _calls(g, m, xs[:3])
        assert _replayed(g) > 0
        _AMP[0] = True
        _calls(g, m, xs[3:5])
        _AMP[0] = False
        _calls(g, m, xs[5:])
    finally:
        _AMP[0] = False


class _AmpInside(_Lin2):
    def forward(self, x):
        h = self.a(x).relu()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # always: graphed under autocast
            y = self.b(h) * 2
            y = y.relu() - h
        if y.sum().item() < -1e9:
            y = -y
        return y * 2 + 1, y


def test_f6c_autocast_entered_inside_the_forward_is_entered_for_the_capture(segments):
    torch.manual_seed(0)
    m = _AmpInside().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(4, 8) for _ in range(5)])
    (plan,) = _plans(g)
    amp = [s for s in plan.segments if plan.calls[s.first].name == "F.linear"
           and s.state.autocast[0][1]]
    assert amp and amp[0].graph is not None and plan.divergences == 0
    with torch.no_grad():  # (then called under autocast: the same calls match)
        for _ in range(3):
            x = torch.randn(4, 8)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, want = g(x), m(x)
            assert _same(got, want)


_DTYPE = [torch.float32]


class _DefaultDtype(_Lin2):
    def forward(self, x):
        h = self.a(x).relu() * 2
        old = torch.get_default_dtype()
        torch.set_default_dtype(_DTYPE[0])  # (no call the mode sees)
        try:
            o = torch.ones(2, 8) * 3  # a factory: its dtype is the default one
        finally:
            torch.set_default_dtype(old)
        return (h + 1, o) if h.sum().item() > -1e9 else (h, o)


def test_f6d_the_default_dtype_set_inside_the_forward(segments):
    torch.manual_seed(0)
    m = _DefaultDtype().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 8) for _ in range(12)]
    try:
        _calls(g, m, xs[:3])
        assert _replayed(g) > 0
        _DTYPE[0] = torch.float64  # later calls: the factory's segment must not be matched
        _calls(g, m, xs[3:])
        (plan,) = _plans(g)  # (recorded again: it cannot be set again for a capture)
        assert "cannot be set again" in "\n".join(plan.describe())
    finally:
        _DTYPE[0] = torch.float32


class _InferenceOff(_Lin2):
    """Makes normal tensors inside a call made under inference_mode (to update them in place
    later, or keep them for autograd)."""

    def forward(self, x):
        with torch.inference_mode(False), torch.no_grad():
            h = self.a(x).relu() * 2
            h.add_(1)
            y = self.b(h) * 3
        return y if y.sum().item() > -1e9 else y


def test_f7_inference_mode_off_inside_an_inference_call(segments):
    """The static buffers and outputs were made after the forward, under the call's inference
    mode: a member met inside inference_mode(False) could not copy into them. Segments now
    capture under their calls' inference mode, and match a call only under it."""
    torch.manual_seed(0)
    m = _InferenceOff().eval()
    g = _graphed(m)
    with torch.inference_mode():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), m(x))
    (plan,) = _plans(g)
    assert plan.segments[0].graph is not None and not plan.segments[0].state.inference
    assert plan.replays > 0 and plan.divergences == 0


_INFERENCE = [True]


class _InferenceSwitch(_Lin2):
    def forward(self, x):
        h = self.a(x).relu()
        with torch.inference_mode(_INFERENCE[0]), torch.no_grad():
            y = self.b(h) * 3  # (nothing copied in: arguments from the segment's own calls)
            y.add_(1)  # an inference tensor may be written only in inference mode
        return y if y.sum().item() > -1e9 else y


def test_f7b_inference_mode_switched_off_after_the_record(segments):
    torch.manual_seed(0)
    m = _InferenceSwitch().eval()
    g = _graphed(m)
    try:
        with torch.inference_mode():
            for k in range(7):
                _INFERENCE[0] = k < 3 or k > 4
                x = torch.randn(4, 8)
                assert torch.equal(g(x), m(x))
                if k == 2:
                    assert _replayed(g) > 0
    finally:
        _INFERENCE[0] = True
    (plan,) = _plans(g)
    assert plan.divergences == 2


class _FreesActivation(_Lin2):
    def forward(self, x):
        h = self.a(x).relu() * 2
        y = self.b(h) + 1
        h.untyped_storage().resize_(0)  # free an activation no longer needed
        return y * 3 if y.sum().item() > -1e9 else y


def test_f8_an_activation_freed_by_the_forward(segments):
    torch.manual_seed(0)
    m = _FreesActivation().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(2, 8) for _ in range(5)])


class _GrowsActivation(_Lin2):
    def forward(self, x):
        h = self.a(x).relu() * 2
        y = self.b(h) + 1
        hc = torch.tensor(h.tolist())  # a boundary reading h
        h.resize_(h.numel() * 4)  # grows: the storage (shared with the graph's) moves
        return y + hc


def test_f8b_an_activation_grown_by_the_forward(segments):
    torch.manual_seed(0)
    m = _GrowsActivation().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(2, 8) for _ in range(5)])


class _ViewOfEager(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)               # alone between boundaries: its segment runs eagerly
        h.clamp_(-1e4, 1e4)         # boundary (writes h in place; no change on these inputs)
        q = h.view(2, 4, 2)         # member: a view of h
        k = q * 2                   # member
        h.mul_(10)                  # boundary: eager's q sees this write
        return q.sum(-1) + k.sum(-1) if k.sum().item() > -1e9 else k


def test_f9_a_view_of_a_tensor_from_an_eager_segment_stays_a_view(segments):
    """A member's argument from a segment that runs eagerly is copied into the graph: a member
    returning a view of it handed out a view of the copy. Such a segment now runs eagerly."""
    torch.manual_seed(0)
    m = _ViewOfEager().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(2, 8) for _ in range(5)])


class _NoOpFloat(_Lin2):
    def forward(self, x):
        h = self.a(x).relu()
        r = h
        h = self.b(h.float())  # a float tensor's .float() is the tensor itself
        h = (h + r) * 2
        return h + 1 if h.sum().item() > -1e9 else h


def test_f10_a_no_op_cast_does_not_make_every_replay_diverge(segments):
    """Performance: a no-op cast (.float() of a float tensor) returns its argument; the replay
    handed out a new alias, so later uses of the argument diverged. It now returns what it is
    given, as eager does."""
    torch.manual_seed(0)
    m = _NoOpFloat().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(2, 8) for _ in range(6)])  # (passes: results are eager's)
    (plan,) = _plans(g)
    assert plan.replays > 0 and plan.divergences == 0


# =============================================================================================
# Attacks that came out right (coverage)
# =============================================================================================


class _ClampInPlace(_Lin2):
    def forward(self, x):
        h = self.a(x).relu() * 2
        h.clamp_(max=3.0)  # a boundary writing a segment's output in place
        y = self.b(h) * 2
        return y + 1 if y.sum().item() > -1e9 else y


def test_an_in_place_write_to_a_handed_output_is_read_by_the_next_segment(segments):
    torch.manual_seed(0)
    m = _ClampInPlace().eval()
    g = _graphed(m)
    # the record's input clamps nothing (verification passes); the later ones do
    _calls(g, m, [torch.full((2, 8), 0.01)] * 2 + [torch.randn(2, 8) * 10 for _ in range(3)])
    assert _replayed(g) > 0


class _Chunks(_Lin2):
    def forward(self, x):
        h = self.a(x) * 2
        p, q = h.chunk(2, dim=-1)
        s, t = torch.split(h, [3, 5], dim=-1)
        if p.sum().item() < -1e9:
            return h
        q.mul_(3)  # writes h's memory through a view
        return torch.cat([p, q, s, t, s], dim=-1) + h.sum(-1, keepdim=True)


def test_chunk_and_split_outputs_written_through_a_view(segments):
    torch.manual_seed(0)
    m = _Chunks().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(2, 8) for _ in range(5)])
    assert _replayed(g) > 0


class _SameTwice(_Lin2):
    def forward(self, x, y):
        h = self.a(x)
        z = torch.cat([h, h, x, y], dim=0) + torch.stack([x, x]).sum(0).repeat(4, 1)
        if z.sum().item() < -1e9:
            return z
        return (z * x.repeat(4, 1) + y.repeat(4, 1)) * 2


def test_the_same_tensor_twice_and_inputs_that_alias(segments):
    torch.manual_seed(0)
    m = _SameTwice().eval()
    g = _graphed(m)
    ins = []
    for _ in range(5):
        base = torch.randn(4, 8)
        ins.append((base[:2], base[:2]))  # the same memory, two views
    _calls(g, m, ins)
    x = torch.randn(2, 8)
    _calls(g, m, [(x, x)] * 4)  # the same object twice


class _TupleOps(_Lin2):
    def forward(self, x):
        h = self.a(x) * 2
        v, i = h.max(dim=-1)
        tv, ti = torch.topk(h, 3)
        sv, si = torch.sort(h, dim=-1)
        if v.sum().item() < -1e9:
            return h
        return (v + tv.sum(-1) + sv[:, 0], i * 2 + ti.sum(-1) + si[:, -1])


def test_ops_returning_namedtuples(segments):
    torch.manual_seed(0)
    m = _TupleOps().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(2, 8) for _ in range(5)])


class _ExpandIn(_Lin2):
    def forward(self, x, e):
        h = self.a(x) * e  # e: stride 0 (expanded)
        if h.sum().item() < -1e9:
            return h
        return (h + e) * 2


def test_an_expanded_input(segments):
    torch.manual_seed(0)
    m = _ExpandIn().eval()
    g = _graphed(m)
    _calls(g, m, [(torch.randn(2, 8), torch.randn(1, 8).expand(2, 8)) for _ in range(5)])


class _ZeroSize(_Lin2):
    def __init__(self):
        super().__init__()
        self.register_buffer("dummy", torch.empty(0))  # (a device marker: address 0)

    def forward(self, x, e):
        h = self.a(x) * 2
        z = torch.cat([e, h], dim=0) + self.dummy.sum()
        w = e * 3 + 1
        if z.sum().item() < -1e9:
            return z
        return z * 2, w, torch.cat([w, z])


def test_zero_size_tensors_and_an_empty_buffer(segments):
    torch.manual_seed(0)
    m = _ZeroSize().eval()
    g = _graphed(m)
    _calls(g, m, [(torch.randn(2, 8), torch.randn(0, 8)) for _ in range(5)])


class _Scalars(_Lin2):
    def forward(self, x):
        h = self.a(x)
        s = h.sum().item()
        zero = -0.0 if s < 0 else 0.0
        fill = float("nan") if s > 1 else 2.5
        y = torch.where(h > 0, h, zero) * 2
        y = torch.where(y > 1, fill, y)
        return (1.0 / y, torch.full_like(y, zero), y.add(h, alpha=2))


def test_python_scalars_signed_zero_and_nan(segments):
    torch.manual_seed(0)
    m = _Scalars().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 8) * 3 for _ in range(8)]
    _calls(g, m, xs + xs)


class _Ints(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, ids):
        h = self.emb(ids) * 2
        k = (ids * 3 + 1) % 16
        if k.max().item() > 100:
            return h
        return self.emb(k) + h, k // 2, ids.cumsum(-1)


def test_integer_tensors(segments):
    torch.manual_seed(0)
    m = _Ints().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randint(0, 16, (2, 5)) for _ in range(5)])


class _Attrs(_Lin2):
    def __init__(self):
        super().__init__()
        self.plain = torch.ones(8)  # a plain tensor attribute (not a buffer)


_GLOBAL = [torch.ones(8)]


class _AttrsForward(_Attrs):
    def forward(self, x):
        h = self.a(x) * self.plain + _GLOBAL[0]
        if h.sum().item() < -1e9:
            return h
        return self.b(h) * self.plain - _GLOBAL[0]


def test_parameters_attributes_and_globals_changed_between_calls(segments):
    torch.manual_seed(0)
    m = _AttrsForward().eval()
    g = _graphed(m)
    x = torch.randn(2, 8)
    _calls(g, m, [x] * 3)
    with torch.no_grad():
        for k in range(3):
            for mod in (m, g):
                mod.a.weight.mul_(0.5)  # in place: read in place
                mod.b.bias.data.copy_(torch.full((8,), float(k)))
                mod.plain.add_(1)  # a plain attribute: copied in on each call
            _GLOBAL[0] = torch.full((8,), float(k))  # rebound
            _calls(g, m, [x])
    assert _replayed(g) > 0


class _Outs(_Lin2):
    def __init__(self):
        super().__init__()
        self.kept = []

    def forward(self, x):
        h = self.a(x).relu() * 2
        if h.sum().item() < -1e9:
            return {}
        y = self.b(h) + 1
        self.kept.append(y)  # graph memory kept past the call: the plan is dropped
        return {"y": y, "list": [y * 2, h], "t": (h + 1,)}


def test_outputs_in_containers_and_kept_on_the_module(segments):
    torch.manual_seed(0)
    m = _Outs().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 8) for _ in range(6)]
    with torch.no_grad():
        outs = [g(x) for x in xs]
        for x, out in zip(xs, outs):
            assert _same(out, m(x))
    for a, b in zip(g.kept, m.kept):
        assert torch.equal(a, b)


class _Raises(_Lin2):
    def forward(self, x):
        h = self.a(x).relu() * 2
        if x[0, 0].item() > 100:
            raise ValueError("bad input")
        y = self.b(h) * 2
        if float(y.sum()) > 1e9:
            raise ValueError("too big")
        return y + 1


def test_an_exception_in_forward_then_more_calls(segments):
    torch.manual_seed(0)
    m = _Raises().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 8) for _ in range(4)]
    _calls(g, m, xs)
    bad = torch.randn(2, 8)
    bad[0, 0] = 1000
    with torch.no_grad(), pytest.raises(ValueError):
        g(bad)
    _calls(g, m, xs)
    with torch.no_grad(), pytest.raises(ValueError):
        g(torch.full((2, 8), 1e6))
    _calls(g, m, xs)
    assert _replayed(g) > 0


class _Hooked(_Lin2):
    def forward(self, x):
        h = self.a(x).relu()
        if h.sum().item() < -1e9:
            return h
        return self.b(h) * 2 + 1


def test_hooks_added_and_removed_after_the_record(segments):
    torch.manual_seed(0)
    m = _Hooked().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 8) for _ in range(4)]
    _calls(g, m, xs)
    handles = [mod.b.register_forward_hook(lambda mod_, i, o: o * 3) for mod in (m, g)]
    handles += [mod.a.register_forward_hook(lambda mod_, i, o: o.mul_(2)) for mod in (m, g)]
    _calls(g, m, xs)
    for h in handles:
        h.remove()
    _calls(g, m, xs)


def test_batch_sizes_that_alternate(segments):
    torch.manual_seed(0)
    m = _Hooked().eval()
    g = _graphed(m)
    xs = [torch.randn(n, 8) for n in (2, 3, 2, 3, 2, 3, 2, 3, 5)]
    _calls(g, m, xs)
    assert _replayed(g) > 0


class _Noise(_Lin2):
    def forward(self, x):
        h = self.a(x)
        n = torch.randn_like(h)
        y = (h + n).relu() * 2
        return y if y.sum().item() > -1e9 else y


def test_random_ops_with_the_generator_reseeded(segments):
    torch.manual_seed(0)
    m = _Noise().eval()
    g = _graphed(m)
    with torch.no_grad():
        for s in range(5):
            x = torch.randn(2, 8)
            torch.manual_seed(s)
            got = g(x)
            torch.manual_seed(s)
            assert torch.equal(got, m(x))


_DEPTH = [0]


class _Recursive(_Lin2):
    def forward(self, x):
        h = self.a(x).relu()
        if _DEPTH[0] == 0:
            _DEPTH[0] += 1
            try:
                h = h * self(x)  # the same module, same signature, inside its own forward
            finally:
                _DEPTH[0] -= 1
        h = self.b(h) * 2
        return h + 1 if h.sum().item() > -1e9 else h


def test_the_module_called_inside_its_own_forward(segments):
    torch.manual_seed(0)
    m = _Recursive().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(2, 8) for _ in range(6)])


def test_inference_mode_calls(segments):
    torch.manual_seed(0)
    m = _Hooked().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 8) for _ in range(5)]
    with torch.inference_mode():
        for x in xs:
            assert torch.equal(g(x), m(x))
    _calls(g, m, xs)  # then no_grad (another key)
    with torch.inference_mode():
        for x in xs:
            assert torch.equal(g(x), m(x))


class _Casts(_Lin2):
    def forward(self, x):
        h = self.a(x).to(torch.float16).relu()
        k = h.float() * 2
        d = k.to(torch.float64) + 1
        if d.sum().item() < -1e9:
            return d
        return (d.half() * 3, k.to(torch.bfloat16), (x.float() + 1).double())


def test_dtype_casts(segments):
    torch.manual_seed(0)
    m = _Casts().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(2, 8) for _ in range(5)])


class _Kw(_Lin2):
    def forward(self, x, *, scale=None, shift=None):
        h = self.a(x) * scale + shift
        if h.sum().item() < -1e9:
            return h
        return torch.add(h, x, alpha=2) * 2


def test_keyword_arguments_in_either_order(segments):
    torch.manual_seed(0)
    m = _Kw().eval()
    g = _graphed(m)
    s, t = torch.randn(8), torch.randn(8)
    with torch.no_grad():
        for k in range(6):
            x = torch.randn(2, 8)
            kw = {"scale": s, "shift": t} if k % 2 else {"shift": t, "scale": s}
            assert torch.equal(g(x, **kw), m(x, **kw))


class _ReturnsInput(_Lin2):
    def forward(self, x):
        h = self.a(x) * 2
        if h.sum().item() < -1e9:
            return h
        return x, (h + 1) * 2, x.view(-1)


def test_outputs_that_are_inputs_or_views_of_them(segments):
    torch.manual_seed(0)
    m = _ReturnsInput().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 8)
            got, want = g(x), m(x)
            assert got[0] is x and _same(got, want)
            assert got[2].data_ptr() == x.data_ptr()


def test_calls_from_a_second_thread_one_at_a_time(segments):
    torch.manual_seed(0)
    m = _Hooked().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 8) for _ in range(6)]
    _calls(g, m, xs[:3])
    res = {}

    def call():
        with torch.no_grad():
            res["y"] = [g(x) for x in xs[3:]]

    t = threading.Thread(target=call)
    t.start()
    t.join(5)
    with torch.no_grad():
        for x, y in zip(xs[3:], res["y"]):
            assert torch.equal(y, m(x))


def test_explain_between_calls(segments):
    from cudagraphify.bench.models import GPT
    torch.manual_seed(0)
    m = GPT(32, 4, 2, sync="item").eval()
    g = _graphed(m)
    xs = [torch.randn(2, 5, 32) for _ in range(6)]
    _calls(g, m, xs[:3])
    str(cg.explain(g, xs[0]))
    str(cg.explain(g))
    _calls(g, m, xs[3:])
    assert cg.stats(g).segment_replays > 0


class _Branch(_Lin2):
    def forward(self, x):
        h = self.a(x).relu()
        n = int((h > 0).sum().item())
        if n % 2:
            h = h * 3
        y = self.b(h)[:, : 1 + n % 4]  # a shape that depends on the value read
        return y * 2 + 1


def test_control_flow_and_shapes_that_depend_on_a_value_read(segments):
    torch.manual_seed(0)
    m = _Branch().eval()
    g = _graphed(m)
    _calls(g, m, [torch.randn(2, 8) for _ in range(10)])
