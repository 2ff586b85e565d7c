"""GPU review of 8f10ea2 (``_replay.of_this_call``: outputs of one graph on one memory, handed
out without a copy by ``copy_outputs=False``, a ``graph_region`` or a piecewise root's chained
pieces, share this call's version counter). Plain python; prints ``PASS name`` / ``FAIL name``.

``finding*`` checks assert eager's behaviour: they FAIL while the finding stands (strict xfails
in tests/test_review_counters.py); ``control*`` checks should PASS. Every result is compared with
an eager twin (``copy.deepcopy`` before graphify) bitwise, and the replays are counted.

Run from the repository root: ``PYTHONPATH=. python .ci/review/counters/gpu_counters.py`` (a few
seconds on an H100); ``CG_REVIEW_SIM=1`` runs the same logic on the CPU double.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
import traceback
import warnings

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture, _trial
from cudagraphify.api import _state_of

warnings.simplefilter("ignore")
SIM = os.environ.get("CG_REVIEW_SIM") == "1"
DEV = "cpu" if SIM else "cuda"
if SIM:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
    from conftest import SimBackend
    _BACKEND = SimBackend()
    _capture.set_backend(_BACKEND)
    torch.cuda.is_current_stream_capturing = lambda: _BACKEND.capturing
_trial.PLAN_TRIAL = False
_capture.CudaBackend.clock = None

T0 = time.perf_counter()
N = 6  # calls per scenario: warm-up, capture, then replays
RESULTS: list[tuple[str, bool]] = []


def sync():
    if not SIM:
        torch.cuda.synchronize()


def check(name, *params):
    def deco(fn):
        for p in params or (None,):
            full = name if p is None else \
                f"{name}[{'-'.join(p) if isinstance(p, tuple) else p}]"
            try:
                fn() if p is None else fn(*p) if isinstance(p, tuple) else fn(p)
                sync()
                ok = True
            except Exception as e:  # noqa: BLE001
                ok = False
                msg = "".join(traceback.format_exception_only(type(e), e)).strip()
                print(f"  ({full}: {msg[:300]})", flush=True)
            RESULTS.append((full, ok))
            print(("PASS " if ok else "FAIL ") + full, flush=True)
        return fn
    return deco


class Root(nn.Module):
    def __init__(self, body, dtype=None):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=dtype)
        self.body = body

    def forward(self, x):
        return self.body(self, x)


def twins(body, dtype=None, **kw):
    torch.manual_seed(0)
    ref = Root(body, dtype).to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def xs(n=N, dtype=None):
    g = torch.Generator(device=DEV).manual_seed(1)
    return [torch.randn(3, 4, generator=g, dtype=dtype, device=DEV) for _ in range(n)]


MODES = {"zero_copy": (dict(copy_outputs=False), contextlib.nullcontext),
         "region": ({}, cg.graph_region)}


def _pair(f):
    return lambda m, x: (lambda y: (y, f(y)))(m.lin(x))


def both(*lists):
    return [(a, b) for a in lists[0] for b in lists[1]]


# -- findings ---------------------------------------------------------------------------------

_OTHER = {"conj": (lambda y: y.conj(), torch.cfloat),
          "view_as_real": (torch.view_as_real, torch.cfloat),
          "real": (lambda y: y.real, torch.cfloat),
          "int_view": (lambda y: y.view(torch.int32), torch.float32)}


@check("finding1_other_dtype_view_shares_base_counter", *both(list(_OTHER), list(MODES)))
def _(how, mode):
    f, dtype = _OTHER[how]
    kw, scope = MODES[mode]
    ref, g = twins(_pair(f), dtype, **kw)
    vg, vw = [], []
    with torch.no_grad(), scope():
        for x in xs(dtype=dtype):
            og, ow = g(x), ref(x)
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
            og[0].add_(1)
            ow[0].add_(1)
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
            vg.append([t._version for t in og])
            vw.append([t._version for t in ow])
    assert cg.stats(g).replays >= 3, cg.stats(g)
    assert vg == vw, (vg, vw)


@check("finding1_write_to_base_of_saved_conj_output_is_caught", *MODES)
def _(mode):
    kw, scope = MODES[mode]
    ref, g = twins(_pair(lambda y: y.conj()), torch.cfloat, **kw)
    inputs = xs(dtype=torch.cfloat)
    raised = {}
    with scope():
        for name, m in (("graph", g), ("eager", ref)):
            w = torch.ones(4, dtype=torch.cfloat, device=DEV, requires_grad=True)
            with torch.no_grad():
                for x in inputs[:-1]:
                    m(x)
                y, c = m(inputs[-1])
            loss = (c * w).abs().sum()
            with torch.no_grad():
                y.add_(1)
            try:
                loss.backward()
                raised[name] = False
            except RuntimeError as e:
                assert "modified by an inplace operation" in str(e)
                raised[name] = True
    assert cg.stats(g).replays >= 3
    assert raised["eager"]
    assert raised["graph"], "the replay's backward used values written after they were saved"


_INF = {"view": lambda y: (y, y[1]), "view_first": lambda y: (y[1], y),
        "two_slices": lambda y: (y[0], y[1])}


@check("finding2_inference_mode_outputs_on_one_memory", *both(list(_INF), list(MODES)))
def _(how, mode):
    kw, scope = MODES[mode]
    f = _INF[how]
    ref, g = twins(lambda m, x: f(m.lin(x) * 2), **kw)
    with torch.inference_mode(), scope():
        for x in xs():
            og, ow = g(x), ref(x)
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
    assert cg.stats(g).replays >= 3


class Pair(nn.Module):
    def __init__(self, how="view"):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        y = self.lin(x)
        return {"view": lambda: (y, y[0]), "view_first": lambda: (y[0], y),
                "t": lambda: (y, y.t()), "detach": lambda: (y, y.detach())}[self.how]()


class PairRoot(nn.Module):
    def __init__(self, how, piece="view"):
        super().__init__()
        self.lin = Pair(piece)
        self.how = how

    def forward(self, x):
        a, b = self.lin(x)
        if self.how == "a":
            self.last = a
            return a
        if self.how == "b":
            self.last = b
            return b
        if self.how == "a_ret_b":
            self.last = a
            return b
        self.last = a  # ret_both
        return a, b


def pair_twins(how, piece):
    torch.manual_seed(0)
    ref = PairRoot(how, piece).to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref))


@check("finding2_inference_mode_piecewise_root")
def _():
    ref, g = pair_twins("a", "view")
    with torch.inference_mode():
        for x in xs():
            og, ow = g(x), ref(x)
            assert torch.equal(og, ow)
    assert cg.stats(g.lin).replays >= 3


@check("finding3_kept_view_output_of_a_piece_is_the_output", "view", "t")
def _(piece):
    ref, g = pair_twins("b", piece)
    same, bad = [], []
    with torch.no_grad():
        for i, x in enumerate(xs()):
            og, ow = g(x), ref(x)
            assert torch.equal(og, ow)
            same.append((og is g.last, ow is ref.last))
            og.add_(i + 1)
            ow.add_(i + 1)
            if not torch.equal(g.last, ref.last):
                bad.append(i)
    st = cg.stats(g.lin)
    print(f"INFO finding3[{piece}] replays={st.replays} of {N} calls", flush=True)
    assert not bad, f"calls {bad}: the kept tensor misses a write through the output"
    assert all(s == (True, True) for s in same), same
    assert st.replays >= N - 2, st


@check("finding4_requires_grad_on_one_slice_stays_on_it", *MODES)
def _(mode):
    kw, scope = MODES[mode]
    ref, g = twins(lambda m, x: (lambda z: (z[0:2], z[1:3]))(m.lin(x) * 2), **kw)
    got = {}
    with scope():
        for name, m in (("graph", g), ("eager", ref)):
            with torch.no_grad():
                for x in xs()[:-1]:
                    m(x)
                a, b = m(xs()[-1])
            a.requires_grad_()
            ((a * 2).sum() + (b * 3).sum()).backward()
            got[name] = (b.requires_grad, b.grad is None, a.grad.clone())
    assert cg.stats(g).replays >= 3
    assert got["eager"][:2] == (False, True)
    assert torch.equal(got["graph"][2], got["eager"][2])
    assert got["graph"][:2] == got["eager"][:2], (got["graph"][:2], got["eager"][:2])


# -- controls ---------------------------------------------------------------------------------

_BODIES = {
    "view": lambda y: (y, y[1]),
    "view_first": lambda y: (y[1], y),
    "detach": lambda y: (y, y.detach()),
    "t": lambda y: (y, y.t()),
    "two_slices": lambda y: (y[0], y[1]),
    "three": lambda y: (y, y[0], y[1:]),
    "view_of_view": lambda y: (y, y[1:], y[1:][0]),
    "dup": lambda y: (y, y),
    "scalar": lambda y: (y, y[1, 2]),
    "offset_noncontig": lambda y: (y[1:, 1:], y[:, 2:]),
}


@check("control_versions_and_values_per_call", *both(list(_BODIES), list(MODES)))
def _(how, mode):
    kw, scope = MODES[mode]
    f = _BODIES[how]
    ref, g = twins(lambda m, x: f(m.lin(x) * 2), **kw)
    held = []
    with torch.no_grad(), scope():
        for x in xs():
            og, ow = g(x), ref(x)
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
            og[-1].add_(1)
            ow[-1].add_(1)
            assert [t._version for t in og] == [t._version for t in ow]
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
            if mode == "region":
                held.append((og[:1], ow[:1]))
            del og, ow
        sync()
        for hg, hw in held:
            assert all(torch.equal(a, b) for a, b in zip(hg, hw))
    assert cg.stats(g).replays >= 4, cg.stats(g)


@check("control_write_to_saved_output_is_caught",
       *both(["view_first", "three", "two_slices"], list(MODES)))
def _(how, mode):
    kw, scope = MODES[mode]
    f = _BODIES[how]
    ref, g = twins(lambda m, x: f(m.lin(x) * 2), **kw)
    inputs = xs()
    with scope():
        for m in (g, ref):
            w = torch.ones(4, device=DEV, requires_grad=True)
            with torch.no_grad():
                for x in inputs[:-2]:
                    m(x)
                o0 = m(inputs[-2])
                o1 = m(inputs[-1])
            loss0 = (o0[-1] * w).sum()
            loss1 = (o1[-1] * w).sum()
            with torch.no_grad():
                o1[0].add_(1)
            loss0.backward()
            assert torch.equal(w.grad, o0[-1].sum(0) if o0[-1].dim() == 2 else o0[-1])
            try:
                loss1.backward()
            except RuntimeError as e:
                assert "modified by an inplace operation" in str(e)
            else:
                raise AssertionError("backward after a write to a saved output's base ran")
    assert cg.stats(g).replays >= 3


@check("control_piecewise_kept_base",
       *both(["a", "a_ret_b", "ret_both"], ["view", "view_first", "t", "detach"]))
def _(how, piece):
    ref, g = pair_twins(how, piece)
    res = []
    with torch.no_grad():
        for i, x in enumerate(xs()):
            og, ow = g(x), ref(x)
            lg = og if isinstance(og, tuple) else (og,)
            lw = ow if isinstance(ow, tuple) else (ow,)
            lg[0].add_(i + 1)
            lw[0].add_(i + 1)
            assert torch.equal(g.last, ref.last)
            res.append((lg, lw))
    sync()
    for lg, lw in res:
        assert all(torch.equal(a, b) for a, b in zip(lg, lw))
    st = cg.stats(g.lin)
    assert st.replays >= N - 2, st
    assert _state_of(g)._chain.moved_outputs == st.replays


@check("control_piecewise_kept_second_non_view", "view_first", "detach")
def _(piece):
    ref, g = pair_twins("b", piece)
    with torch.no_grad():
        for i, x in enumerate(xs()):
            og, ow = g(x), ref(x)
            assert torch.equal(og, ow) and og is g.last and ow is ref.last
            og.add_(i + 1)
            ow.add_(i + 1)
            assert torch.equal(g.last, ref.last)
    assert cg.stats(g.lin).replays >= N - 2


@check("control_inference_mode_same_geometry_detach", *MODES)
def _(mode):
    kw, scope = MODES[mode]
    ref, g = twins(_pair(lambda y: y.detach()), **kw)
    with torch.inference_mode(), scope():
        for x in xs():
            og, ow = g(x), ref(x)
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
            og[1].add_(1)
            ow[1].add_(1)
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
    assert cg.stats(g).replays >= 3


@check("control_metadata_ops_on_regeometried_output",
       "t_", "resize_", "detach_", "requires_grad_", "set_")
def _(op):
    ref, g = twins(lambda m, x: (lambda y: (y[1], y))(m.lin(x)), copy_outputs=False)
    inputs = xs()
    got = {}
    for name, m in (("graph", g), ("eager", ref)):
        with torch.no_grad():
            for x in inputs[:-2]:
                m(x)
            a, y = m(inputs[-2])
        if op == "set_":
            y.set_(torch.zeros(5, device=DEV))
        elif op == "resize_":
            y.resize_(2, 2)
        else:
            getattr(y, op)()
        a_vals = a.clone()
        with torch.no_grad():
            nxt = m(inputs[-1])
        got[name] = (tuple(y.shape), y.stride(), y.requires_grad, a._version, a_vals,
                     [t.clone() for t in nxt])
    e, gr = got["eager"], got["graph"]
    assert e[:4] == gr[:4], (e[:4], gr[:4])
    assert torch.equal(e[4], gr[4])
    assert all(torch.equal(p, q) for p, q in zip(e[5], gr[5]))
    assert cg.stats(g).replays >= 3


fails = [n for n, ok in RESULTS if not ok]
print(f"SUMMARY {len(RESULTS) - len(fails)}/{len(RESULTS)} passed in "
      f"{time.perf_counter() - T0:.1f} s" + (f"; failed: {', '.join(fails)}" if fails else ""))
sys.exit(1 if fails else 0)
