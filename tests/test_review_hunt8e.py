"""Review hunt 8e (of 5dcf40f, with f8c82f7's key item ``_signature.repeated``: a tensor passed
twice gets ONE static copy, ``StaticInputs._build``, so the capture sees ``x is y`` as the call
does; no eager fast path for such a call; attribute refusals by argument object). CPU, on the
simulated backend (``sim``); every scenario runs a graphified twin beside an eager one
(``copy.deepcopy`` before ``graphify``), compared bitwise, and ``cg.stats`` proves the replays.

Status since the fix that followed this review: every finding below (S1-S3, L1, C1) is fixed
and its test a plain test: a borrowed slot passed twice is the buffer of both leaves, a copied
leaf that is one object with a leaf read in place is read in place too, ``bucketed`` keys and
pads a tensor passed twice once, and the replay (and a training graph) copies a shared buffer
in once.

Findings (strict xfails when found; each asserts the right behaviour and failed because of it):

Silent (a replay that differs from eager; no error, no warning, no eager call):

- S1 a graph's output passed twice to the next graph, chained (``graph_region``, or the
  implicit region of a piecewise plan's pieces): ``GraphRegion.borrowable`` lets the FIRST leaf
  borrow the slot ("the same alias twice: one leaf borrows it, the others copy") and
  ``StaticInputs._build`` records ``first[id(leaf)]`` only in its copy branch, so the repeated
  leaf gets a buffer of its own: the capture runs ``f(slot, copy)`` where the call is
  ``f(h, h)``. A branch on ``x is y`` that changes a value (not an op) replays the
  not-one-object branch, from the very first call of the region:
  ``test_s1_chained_output_passed_twice[region_per_call|one_region|piecewise]`` (the plain
  ``f(t, t)`` is right since 5dcf40f: ``test_control_repeated_positional_outputs``). Fix:
  in ``_build``, ``first.setdefault(id(leaf), i)`` in the borrow branch too (later repeats
  then share ``borrow[i]``), or ``borrowable`` borrowing the slot for every leaf that IS the
  same object.
- S2 one object passed at a static position (``static_argnames``) and at a copied one,
  ``g(x, kv=x)`` with ``static_argnames="kv"``: ``_build`` shares only between copied leaves
  (``not static``; a static leaf never enters ``first``), so the capture runs
  ``f(copy_of_x, x)``: ``x is kv`` False on every replay:
  ``test_s2_static_name_and_copied_position_one_object``. (Not new in 5dcf40f: the leaves got
  one copy each before; the repeated key does not reach it.) Fix: a copied leaf that is the
  same object as a static leaf is read in place too (``leaves.append(leaf)``, no buffer).
- S3 ``cg.bucketed``: its key (``Bucketed.__call__``: spec, per-leaf shapes) has no
  ``repeated`` item and ``_pad`` pads each leaf apart, so ``b(t, t)`` after ``b(a, b_)`` (same
  shapes) is verified by the distinct call's check and replays the padded distinct call:
  ``x is y`` False: ``test_s3_bucketed_pads_a_repeated_tensor_apart``. (Not new; the same hole
  as hunt 8d's key fix, in bucketing.) Fix: ``repeated(leaves)`` in the bucket key, and pad a
  repeated leaf once (the same padded object at each of its positions).

Loud (a needless eager run):

- L1 the same cause as S1 where the branch changes ops: ``nn.MultiheadAttention``
  self-attention (``mha(h, h, h)``, ``query is key`` in ``F.multi_head_attention_forward``)
  after a graphed piece in a piecewise plan (a root refused for ``.item()``), or after another
  graph in a ``graph_region``: the capture on (slot, copy, copy) takes the other path, the
  two-run check refuses ("control flow ... the op sequence differs"): the MHA piece runs
  eagerly on every call (called alone, ``mha(h, h, h)`` is graphed since 5dcf40f):
  ``test_l1_self_attention_after_a_graphed_piece[piecewise|region]``.

Cost:

- C1 the shared buffer is copied in once per leaf: ``CapturedGraph._copy_in`` keeps
  ``(i, buf)`` for both leaves of ``f(t, t)`` (``inputs.copy``), so every replay copies ``t``
  into the same buffer twice (``stats.input_copies`` = 2 per replay; also
  ``TrainingGraph._copy``): ``test_c1_repeated_tensor_copied_in_once_per_replay``. Fix: keep
  one ``(i, buf)`` per buffer in ``_copy_in`` (the key guarantees the other leaf is the same
  object).

Controls (plain tests, pass):

- ``f(t, t)`` returning ``x, y, x[0], y[1]`` and an ``x is y`` scalar branch: the caller's
  object for both, views of it, with ``copy_outputs`` True and False:
  ``test_control_repeated_positional_outputs[*]``.
- training (grad mode, parameters require grad) with a repeated tensor that does not require
  grad: output and parameter gradients bitwise, replays; with one that requires grad: refused
  (eager, right): ``test_control_training_repeated[*]``.
- a repeated tensor in a list and as a keyword (``g([t, t], y=t)``, alternating with
  ``[t, u]``): ``test_control_repeated_in_containers``.
- ``num_warmup_iters=3``: ``test_control_extra_warmups``.
- a module parameter passed twice; ``static_argnames`` naming both; ``mark_static``:
  ``test_control_repeated_read_in_place[*]``.
- ``f(t, t)`` and ``f(t, t.clone())`` alternating: two graphs, each replayed:
  ``test_control_repeated_and_clone_alternate``.
- ``x.add_(1)`` in ``f(x, x)``: eager, the argument written once as eager:
  ``test_control_write_to_a_repeated_tensor``.
- a region graph's output passed once with another tensor (``g2(h, other)``): replays right:
  ``test_control_chained_output_passed_once``.
- ``capture_sizes`` with ``(t, t)`` inputs: ``test_control_capture_sizes_repeated``.
- ``cg.bucketed`` with distinct tensors only: ``test_control_bucketed_distinct``.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("quiet")



def _st(g) -> str:
    s = cg.stats(g)
    return f"captures={s.captures} replays={s.replays} eager={dict(s.eager_calls)}"


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return x * self.w + 0.5


class Body(nn.Module):
    """A value (not an op) that depends on ``x is y``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x, y):
        return x * self.w * (2.0 if x is y else 3.0) + y


def _replays(m) -> int:
    try:
        return cg.stats(m).replays
    except cg.CudagraphifyUsageError:  # (a piece not graphified before the plan's first call)
        return 0


def _twin(make, **kw):
    torch.manual_seed(0)
    ref = make()
    return cg.graphify(copy.deepcopy(ref), **kw), ref


# ============================== S1 a chained output passed twice ============================

class Root(nn.Module):
    """A root refused (``.item()``): a piecewise plan, ``a`` and ``b`` its pieces, chained."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Lin(), Body()

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > 1e9:
            h = h + 1
        return self.b(h, h)


@pytest.mark.parametrize("how", ["region_per_call", "one_region", "piecewise"])
def test_s1_chained_output_passed_twice(sim, how):
    calls = []
    with torch.no_grad():
        if how == "piecewise":
            g, ref = _twin(Root)
            for i in range(5):
                x = torch.randn(4, 8)
                r0 = _replays(g.b)
                calls.append((torch.equal(g(x), ref(x)), _replays(g.b) - r0))
            gb = g.b
        else:
            torch.manual_seed(0)
            r1, r2 = Lin(), Body()
            g1, gb = cg.graphify(copy.deepcopy(r1)), cg.graphify(copy.deepcopy(r2))
            region = cg.graph_region()
            if how == "one_region":
                region.__enter__()
            try:
                for i in range(5):
                    x = torch.randn(4, 8)
                    if how == "region_per_call":
                        with cg.graph_region():
                            h = g1(x)
                            r0 = cg.stats(gb).replays
                            got = gb(h, h).clone()
                    else:
                        h = g1(x)
                        r0 = cg.stats(gb).replays
                        got = gb(h, h).clone()
                    hr = r1(x)
                    calls.append((torch.equal(got, r2(hr, hr)), cg.stats(gb).replays - r0))
            finally:
                if how == "one_region":
                    region.__exit__(None, None, None)
    assert cg.stats(gb).replays >= 3, (calls, _st(gb))
    assert all(ok for ok, _ in calls), (
        f"silent: the chained h passed twice was captured as (slot, copy): {calls} {_st(gb)}")


# ============================== S2 a static name and a copied position, one object ========

class KV(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x, kv):
        return x * self.w * (2.0 if x is kv else 3.0) + kv


def test_s2_static_name_and_copied_position_one_object(sim):
    g, ref = _twin(KV, static_argnames="kv")
    x = torch.randn(4, 8)
    calls = []
    with torch.no_grad():
        for i in range(5):
            x.copy_(torch.randn(4, 8))  # (the same object: the static leaf's address is keyed)
            r0 = cg.stats(g).replays
            calls.append((torch.equal(g(x, kv=x), ref(x, kv=x)), cg.stats(g).replays - r0))
    assert cg.stats(g).replays >= 3, (calls, _st(g))
    assert all(ok for ok, _ in calls), (
        f"silent: x copied, kv read in place: x is kv False in the capture: {calls} {_st(g)}")


# ============================== S3 bucketed pads a repeated tensor apart ====================

def _bucketed_calls(pattern):
    g, ref = _twin(Body)
    b = cg.bucketed(g, [8])
    calls = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for i, p in enumerate(pattern):
            torch.manual_seed(10 + i)
            a, c = torch.randn(4, 8), torch.randn(4, 8)
            args = (a, a) if p == "same" else (a, c)
            r0 = cg.stats(g).replays
            calls.append((p, torch.equal(b(*args), ref(*args)), cg.stats(g).replays - r0))
    return g, b, calls


def test_s3_bucketed_pads_a_repeated_tensor_apart(sim):
    g, b, calls = _bucketed_calls(["distinct"] * 3 + ["same"] * 3)
    assert all(ok for p, ok, _ in calls if p == "distinct"), (calls, _st(g))
    assert sum(r for p, _, r in calls if p == "same") >= 2, (calls, _st(g), b.refused)
    assert all(ok for _, ok, _ in calls), (
        f"silent: b(t, t) padded to two objects, the distinct calls' check: {calls} {_st(g)}")


def test_control_bucketed_distinct(sim):
    g, b, calls = _bucketed_calls(["distinct"] * 5)
    assert all(ok for _, ok, _ in calls), (calls, _st(g))
    assert sum(r for _, _, r in calls) >= 3 and not b.refused, (calls, _st(g), b.refused)


# ============================== L1 self-attention after a graphed piece =====================

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        h = self.ln(x)
        if h.sum().item() > 1e9:  # (the root refused: a piecewise plan)
            h = h + 1
        return self.mha(h, h, h, need_weights=False)[0] + x


@pytest.mark.parametrize("how", ["piecewise", "region"])
def test_l1_self_attention_after_a_graphed_piece(sim, how):
    torch.manual_seed(0)
    with torch.no_grad():
        if how == "piecewise":
            ref = Block().eval()
            g = cg.graphify(copy.deepcopy(ref))
            for _ in range(5):
                g(torch.randn(2, 5, 16))
            gm = g.mha
        else:
            ln, mha = nn.LayerNorm(16), nn.MultiheadAttention(16, 2, batch_first=True).eval()
            gl, gm = cg.graphify(ln), cg.graphify(mha)
            with cg.graph_region():
                for _ in range(5):
                    h = gl(torch.randn(2, 5, 16))
                    gm(h, h, h, need_weights=False)
    # (values: the sim's capture runs under a dispatch mode, which turns MHA's native fast
    # path off, a few ulps from eager: not asserted; the GPU script compares them)
    assert cg.stats(gm).replays >= 3 and not cg.stats(gm).eager_calls, (
        f"loud: the self-attention piece runs eagerly: {_st(gm)}")


# ============================== C1 the shared buffer copied in twice ========================

def test_c1_repeated_tensor_copied_in_once_per_replay(sim):
    g, ref = _twin(Body)
    with torch.no_grad():
        for _ in range(5):
            t = torch.randn(4, 8)
            assert torch.equal(g(t, t), ref(t, t))
    s = cg.stats(g)
    assert s.replays == 4, _st(g)
    assert s.input_copies == s.replays, (
        f"cost: {s.input_copies} input copies for {s.replays} replays of f(t, t)")


# ============================== controls ====================================================

class Ret(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x, y):
        return x, y, x[0], y[1], x * self.w * (2.0 if x is y else 3.0)


@pytest.mark.parametrize("copy_outputs", [True, False])
def test_control_repeated_positional_outputs(sim, copy_outputs):
    g, ref = _twin(Ret, copy_outputs=copy_outputs)
    calls = []
    with torch.no_grad():
        for i in range(5):
            t = torch.randn(4, 8)
            r0 = cg.stats(g).replays
            got, want = g(t, t), ref(t, t)
            calls.append((all(torch.equal(p, q) for p, q in zip(got, want)),
                          got[0] is t and got[1] is t, got[2]._base is t and got[3]._base is t,
                          cg.stats(g).replays - r0))
    assert all(a and b and c for a, b, c, _ in calls), (calls, _st(g))
    assert [r for *_, r in calls] == [0, 1, 1, 1, 1], (calls, _st(g))


@pytest.mark.parametrize("x_grad", [False, True])
def test_control_training_repeated(sim, x_grad):
    g, ref = _twin(Body)
    calls = []
    for i in range(5):
        torch.manual_seed(i)
        t = torch.randn(4, 8, requires_grad=x_grad)
        t2 = t.detach().clone().requires_grad_(x_grad)
        r0 = cg.stats(g).replays
        a, b = g(t, t), ref(t2, t2)
        a.sum().backward()
        b.sum().backward()
        ok = torch.equal(a, b) and torch.equal(g.w.grad, ref.w.grad) \
            and (not x_grad or torch.equal(t.grad, t2.grad))
        calls.append((ok, cg.stats(g).replays - r0))
    assert all(ok for ok, _ in calls), (calls, _st(g))
    if x_grad:
        assert cg.stats(g).replays == 0 and any(
            "passed twice" in k for k in cg.stats(g).eager_calls), _st(g)
    else:
        assert [r for _, r in calls] == [0, 1, 1, 1, 1], (calls, _st(g))


class Lst(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, xs, y=None):
        return xs[0] * self.w * (2.0 if xs[0] is xs[1] else 3.0) \
            + (5.0 if y is xs[0] else 7.0)


def test_control_repeated_in_containers(sim):
    g, ref = _twin(Lst)
    calls = []
    with torch.no_grad():
        for i in range(8):
            t, u = torch.randn(4, 8), torch.randn(4, 8)
            xs = [t, t] if i % 2 else [t, u]
            r0 = cg.stats(g).replays
            calls.append((torch.equal(g(xs, y=t), ref(xs, y=t)), cg.stats(g).replays - r0))
    assert all(ok for ok, _ in calls), (calls, _st(g))
    assert sum(r for _, r in calls) == 6 and cg.stats(g).captures == 2, (calls, _st(g))


def test_control_extra_warmups(sim):
    g, ref = _twin(Body, num_warmup_iters=3)
    calls = []
    with torch.no_grad():
        for i in range(5):
            t = torch.randn(4, 8)
            r0 = cg.stats(g).replays
            calls.append((torch.equal(g(t, t), ref(t, t)), cg.stats(g).replays - r0))
    assert all(ok for ok, _ in calls) and cg.stats(g).replays == 4, (calls, _st(g))


class P3(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.p = nn.Parameter(torch.randn(4, 8))

    def forward(self, x, y, z):
        return z * self.w * (2.0 if x is y else 3.0) + y


@pytest.mark.parametrize("how", ["parameter", "static_argnames_both", "mark_static"])
def test_control_repeated_read_in_place(sim, how):
    torch.manual_seed(0)
    calls = []
    with torch.no_grad():
        if how == "parameter":
            ref = P3()
            net = copy.deepcopy(ref)
            g = cg.graphify(net)
            for i in range(5):
                z = torch.randn(4, 8)
                r0 = cg.stats(g).replays
                calls.append((torch.equal(g(net.p, net.p, z), ref(ref.p, ref.p, z)),
                              cg.stats(g).replays - r0))
        else:
            ref = KV()
            g = cg.graphify(copy.deepcopy(ref), **(
                {"static_argnames": ("x", "kv")} if how == "static_argnames_both" else {}))
            x = torch.randn(4, 8)
            if how == "mark_static":
                cg.mark_static(x)
            for i in range(5):
                x.copy_(torch.randn(4, 8))
                r0 = cg.stats(g).replays
                calls.append((torch.equal(g(x=x, kv=x), ref(x=x, kv=x)),
                              cg.stats(g).replays - r0))
    assert all(ok for ok, _ in calls), (calls, _st(g))
    assert [r for _, r in calls] == [0, 1, 1, 1, 1], (calls, _st(g))


def test_control_repeated_and_clone_alternate(sim):
    g, ref = _twin(Body)
    calls = []
    with torch.no_grad():
        for i in range(8):
            t = torch.randn(4, 8)
            y = t if i % 2 == 0 else t.clone()
            r0 = cg.stats(g).replays
            calls.append((torch.equal(g(t, y), ref(t, y)), cg.stats(g).replays - r0))
    assert all(ok for ok, _ in calls), (calls, _st(g))
    assert cg.stats(g).captures == 2 and [r for _, r in calls[2:]] == [1] * 6, (calls, _st(g))


class Writes(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x, y):
        x.add_(1.0)
        return y * self.w


def test_control_write_to_a_repeated_tensor(sim):
    g, ref = _twin(Writes)
    calls = []
    with torch.no_grad():
        for i in range(4):
            t = torch.randn(4, 8)
            t2 = t.clone()
            calls.append((torch.equal(g(t, t), ref(t2, t2)), torch.equal(t, t2)))
    assert all(a and b for a, b in calls), (calls, _st(g))
    assert any("share memory" in k for k in cg.stats(g).eager_calls), _st(g)


def test_control_chained_output_passed_once(sim):
    torch.manual_seed(0)
    r1, r2 = Lin(), Body()
    g1, g2 = cg.graphify(copy.deepcopy(r1)), cg.graphify(copy.deepcopy(r2))
    calls = []
    with torch.no_grad(), cg.graph_region():
        for i in range(5):
            x, o = torch.randn(4, 8), torch.randn(4, 8)
            h = g1(x)
            r0 = cg.stats(g2).replays
            got = g2(h, o).clone()
            calls.append((torch.equal(got, r2(r1(x), o)), cg.stats(g2).replays - r0))
    assert all(ok for ok, _ in calls) and cg.stats(g2).replays >= 4, (calls, _st(g2))


def test_control_capture_sizes_repeated(sim):
    g, ref = _twin(Body)
    with torch.no_grad():
        def same(n):
            t = torch.randn(n, 8)
            return (t, t)
        cg.capture_sizes(g, same, [8, 4], progress=False)
        calls = []
        for n in (4, 8, 4):
            t = torch.randn(n, 8)
            r0 = cg.stats(g).replays
            calls.append((torch.equal(g(t, t), ref(t, t)), cg.stats(g).replays - r0))
    assert all(ok for ok, _ in calls) and [r for _, r in calls] == [1, 1, 1], (calls, _st(g))
