"""GPU review of ed312f8 (a piecewise root's output that is also kept elsewhere, ``self.last =
h; return h``, is handed to the caller as the moved alias itself, or a view of it). Plain
python; prints ``PASS name`` / ``FAIL name``.

``finding*`` checks assert eager's behaviour: they FAIL while the finding stands (strict xfails
in tests/test_review_kept.py); ``control*`` checks should PASS. Every result is compared with an
eager twin (``copy.deepcopy`` before graphify) bitwise, also after later calls' replays (on the
GPU the graph memory is really reused), and the piece's replays are counted.

Run from the repository root: ``PYTHONPATH=. python .ci/review/kept/gpu_kept.py`` (a few
seconds on an H100); ``CG_REVIEW_SIM=1`` runs the same logic on the CPU double.
"""

from __future__ import annotations

import collections
import copy
import os
import sys
import threading
import time
import traceback
import warnings
import weakref

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture, _trial
from cudagraphify.api import _state_of

warnings.simplefilter("ignore")
# (CG_REVIEW_SIM=1: a dry run of this script's logic on the CPU with tests/conftest.py's
# simulated backend)
SIM = os.environ.get("CG_REVIEW_SIM") == "1"
DEV = "cpu" if SIM else "cuda"
if SIM:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
    from conftest import SimBackend
    _BACKEND = SimBackend()
    _capture.set_backend(_BACKEND)
    torch.cuda.is_current_stream_capturing = lambda: _BACKEND.capturing
# the chained path must run whatever the machine's speed: no plan trial (a one-Linear plan may
# be given back), no piece trial
_trial.PLAN_TRIAL = False
_capture.CudaBackend.clock = None

T0 = time.perf_counter()
N = 6  # calls per scenario: 2 warm-up/capture, then replays
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


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y[0]


class PairRoot(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = Pair()
        self.how = how

    def forward(self, x):
        a, b = self.lin(x)
        if self.how == "a":
            self.last = a
            return a
        if self.how == "b_ret_a":
            self.last = b
            return a
        self.last = a  # a_ret_b
        return b


class Sub(torch.Tensor):
    pass


def twins(body_or_module, **kw):
    torch.manual_seed(0)
    ref = body_or_module if isinstance(body_or_module, nn.Module) else Root(body_or_module, **kw)
    ref = ref.to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref))


def xs(n=N, dtype=None, rows=3):
    g = torch.Generator(device=DEV).manual_seed(1)
    return [torch.randn(rows, 4, generator=g, dtype=dtype, device=DEV) for _ in range(n)]


def run(ref, g, inputs=None, post=None):
    out = []
    with torch.no_grad():
        for i, x in enumerate(inputs if inputs is not None else xs()):
            og, ow = g(x), ref(x)
            if post is not None:
                post(i, g, og, ref, ow)
            out.append((og, ow))
    return out


def leaves(o):
    if isinstance(o, torch.Tensor):
        return [o]
    if isinstance(o, dict):
        return [t for v in o.values() for t in leaves(v)]
    if isinstance(o, (list, tuple)):
        return [t for v in o for t in leaves(v)]
    return []


def all_equal(results):
    for i, (og, ow) in enumerate(results):
        lg, lw = leaves(og), leaves(ow)
        assert len(lg) == len(lw), i
        for a, b in zip(lg, lw):
            assert a.dtype == b.dtype and torch.equal(a, b), f"result {i} differs from eager"


def replayed(g, at_least=N - 2):
    r = cg.stats(g.lin).replays
    assert r >= at_least, f"replays {r} < {at_least}: the graph path did not run"


# -- findings ---------------------------------------------------------------------------------

@check("finding1_subclass_alias_of_kept_keeps_class")
def _():
    def body(m, x):
        h = m.lin(x)
        m.last = h
        return h.as_subclass(Sub)
    ref, g = twins(body)
    seen = []
    all_equal(run(ref, g, post=lambda i, g, og, r, ow: seen.append((type(og).__name__,
                                                                    type(ow).__name__))))
    replayed(g)
    assert all(a == b == "Sub" for a, b in seen), seen


@check("finding2_int_view_beside_kept_output_stays_aliased")
def _():
    def body(m, x):
        h = m.lin(x)
        m.last = h
        return h, h.view(torch.int32)
    ref, g = twins(body)

    def post(i, g, og, r, ow):
        og[0].add_(1)
        ow[0].add_(1)
        assert torch.equal(og[1], ow[1]), f"call {i}: out[1] misses the write to out[0]"
    all_equal(run(ref, g, post=post))
    replayed(g)


@check("finding3_other_dtype_or_conj_view_of_kept_shares_memory", "int32", "conj")
def _(how):
    dtype = torch.cfloat if how == "conj" else None

    def body(m, x):
        h = m.lin(x)
        m.last = h
        return h.conj() if how == "conj" else h.view(torch.int32)
    ref, g = twins(body, dtype=dtype)

    def post(i, g, og, r, ow):
        og.add_(1)
        ow.add_(1)
        assert torch.equal(g.last, r.last), f"call {i}: the kept tensor misses the write"
    all_equal(run(ref, g, xs(dtype=dtype), post))
    replayed(g)


@check("finding4_results_of_calls_have_own_version_counters")
def _():
    ref, g = twins(PairRoot("a"))
    res = run(ref, g)
    all_equal(res)
    replayed(g)
    res[-1][0].add_(1)
    res[-1][1].add_(1)
    vg, vw = [o._version for o, _ in res], [o._version for _, o in res]
    assert vg == vw, (vg, vw)


@check("finding4_backward_saving_earlier_result")
def _():
    ref, g = twins(PairRoot("a"))
    inputs = xs()
    w = torch.ones(4, device=DEV, requires_grad=True)
    grads = []
    for m in (ref, g):
        with torch.no_grad():
            outs = [m(x) for x in inputs]
        loss = (outs[-2] * w).sum()
        with torch.no_grad():
            outs[-1].add_(1)
        loss.backward()
        grads.append(w.grad.clone())
        w.grad = None
    replayed(g)
    assert torch.equal(grads[0], grads[1])


def _kept_view(m, x):
    h = m.lin(x)
    m.last = h[:2]
    return h[1:]


def _kept_detach(m, x):
    h = m.lin(x)
    m.last = h.detach()
    return h


def _kept_and_view(m, x):
    h = m.lin(x)
    m.last = h
    m.row = h[0]
    return h


def _kept_dict(m, x):
    h = m.lin(x)
    m.last = h
    m.d = {"h": h, "row": h[0]}
    return h


def _kept_base_view(m, x):
    h = m.lin(x)
    m.last = h[1:]
    return h


_UNMOVABLE = {"view": _kept_view, "detach": _kept_detach, "alias_and_view": _kept_and_view,
              "dict_with_view": _kept_dict, "view_of_returned": _kept_base_view}


@check("finding5_output_shares_memory_with_unmovable_kept", *_UNMOVABLE)
def _(how):
    ref, g = twins(_UNMOVABLE[how])
    bad = []

    def post(i, g, og, r, ow):
        og.add_(1)
        ow.add_(1)
        if not torch.equal(g.last, r.last):
            bad.append(i)
    all_equal(run(ref, g, post=post))
    print(f"INFO finding5[{how}] replays={cg.stats(g.lin).replays} of {N} calls", flush=True)
    replayed(g, 2)
    assert not bad, f"calls {bad}: the kept tensor misses a write through the output"


@check("finding6_returned_kept_container_is_kept_one")
def _():
    def body(m, x):
        h = m.lin(x)
        m.kept = [h]
        return m.kept
    ref, g = twins(body)
    same = []
    all_equal(run(ref, g, post=lambda i, g, og, r, ow: same.append((og is g.kept, ow is r.kept))))
    replayed(g)
    assert all(s == (True, True) for s in same), same


@check("finding6_one_container_returned_twice")
def _():
    def body(m, x):
        h = m.lin(x)
        m.last = h
        lst = [h]
        return lst, lst
    ref, g = twins(body)
    same = []
    all_equal(run(ref, g, post=lambda i, g, og, r, ow: same.append((og[0] is og[1],
                                                                    ow[0] is ow[1]))))
    replayed(g)
    assert all(s == (True, True) for s in same), same


@check("finding7_torch_size_stays_size", "kept", "not_kept")
def _(how):
    def body(m, x):
        h = m.lin(x)
        if how == "kept":
            m.last = h
        else:
            m.calls = getattr(m, "calls", 0) + 1
        return h, h.shape
    ref, g = twins(body)
    kinds = []
    all_equal(run(ref, g, post=lambda i, g, og, r, ow: kinds.append((type(og[1]).__name__,
                                                                     type(ow[1]).__name__))))
    replayed(g)
    assert all(a == b == "Size" for a, b in kinds), kinds


@check("finding8_weakref_kept_by_forward_is_output")
def _():
    def body(m, x):
        h = m.lin(x)
        m.ref = weakref.ref(h)
        return h
    ref, g = twins(body)
    same = []
    all_equal(run(ref, g, post=lambda i, g, og, r, ow: same.append((g.ref() is og,
                                                                    r.ref() is ow))))
    replayed(g)
    assert all(s == (True, True) for s in same), same


@check("finding9_returned_base_of_kept_view_is_its_base")
def _():
    ref, g = twins(PairRoot("b_ret_a"))
    rel = []

    def post(i, g, og, r, ow):
        rel.append((g.last._base is og, r.last._base is ow))
        og.add_(1)
        ow.add_(1)
        assert torch.equal(g.last, r.last), i
    all_equal(run(ref, g, post=post))
    replayed(g)
    assert all(s == (True, True) for s in rel), rel


# -- controls ---------------------------------------------------------------------------------

def _write_shows_in_kept(i, g, og, r, ow):
    og.add_(i + 1)
    ow.add_(i + 1)
    assert torch.equal(g.last, r.last), f"call {i}: the kept tensor misses the write"


_VIEWS = {
    "transposed": lambda h: h.t(),
    "offset_noncontiguous": lambda h: h[1:, 2:],
    "expanded_row": lambda h: h[0].expand(3, 4),
    "empty_slice": lambda h: h[3:],
    "detached": lambda h: h.detach(),
    "flattened": lambda h: h.view(-1),
}


@check("control_same_dtype_views_of_kept", *_VIEWS)
def _(how):
    view = _VIEWS[how]

    def body(m, x):
        h = m.lin(x)
        m.last = h
        return view(h), h
    ref, g = twins(body)

    def post(i, g, og, r, ow):
        assert og[1] is g.last and ow[1] is r.last
        assert og[0].stride() == ow[0].stride()
        assert og[0].storage_offset() == ow[0].storage_offset()
        assert og[0].untyped_storage().data_ptr() == g.last.untyped_storage().data_ptr()
        og[1].add_(i + 1)
        ow[1].add_(i + 1)
        assert torch.equal(og[0], ow[0]), i
    all_equal(run(ref, g, post=post))
    replayed(g)
    moved = _state_of(g)._chain.moved_outputs
    assert moved == cg.stats(g.lin).replays, (moved, cg.stats(g.lin).replays)


@check("control_kept_in_many_places")
def _():
    def body(m, x):
        h = m.lin(x)
        m.last = h
        m.also = h
        m.hist = [h, h]
        return {"h": h, "n": 3}
    ref, g = twins(body)

    def post(i, g, og, r, ow):
        assert og["h"] is g.last is g.also is g.hist[1] and og["n"] == 3
        _write_shows_in_kept(i, g, og["h"], r, ow["h"])
    all_equal(run(ref, g, post=post))
    replayed(g)


@check("control_namedtuple_output")
def _():
    NT = collections.namedtuple("NT", "h n")

    def body(m, x):
        h = m.lin(x)
        m.last = h
        return NT(h, 3)
    ref, g = twins(body)

    def post(i, g, og, r, ow):
        assert type(og) is NT and og.h is g.last and og.n == 3
    all_equal(run(ref, g, post=post))
    replayed(g)


@check("control_non_lone_outputs", "a", "a_ret_b")
def _(how):
    ref, g = twins(PairRoot(how))

    def post(i, g, og, r, ow):
        og.add_(1)
        ow.add_(1)
        assert torch.equal(g.last, r.last), i
        assert og is g.last if how == "a" else og._base is g.last
    all_equal(run(ref, g, post=post))
    replayed(g)


@check("control_modes", "inference_mode", "copy_outputs_false", "user_region")
def _(mode):
    def body(m, x):
        h = m.lin(x)
        m.last = h
        return h
    torch.manual_seed(0)
    ref = Root(body).to(DEV)
    g = cg.graphify(copy.deepcopy(ref), copy_outputs=mode != "copy_outputs_false")
    res = []
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    region = cg.graph_region() if mode == "user_region" else None
    with ctx:
        if region is not None:
            region.__enter__()
        try:
            for i, x in enumerate(xs()):
                og, ow = g(x), ref(x)
                assert og is g.last and ow is ref.last
                assert og.is_inference() == ow.is_inference()
                _write_shows_in_kept(i, g, og, ref, ow)
                res.append((og, ow))
        finally:
            if region is not None:
                region.__exit__(None, None, None)
    all_equal(res)
    replayed(g)


@check("control_exception_after_piece")
def _():
    def body(m, x):
        h = m.lin(x)
        m.last = h
        if x[0, 0] > 100:
            raise ValueError("boom")
        return h
    ref, g = twins(body)
    inputs = xs(8)
    inputs[3][0, 0] = 1000
    inputs[4][0, 0] = 1000
    kept = []
    with torch.no_grad():
        for x in inputs:
            for m in (g, ref):
                try:
                    m(x)
                except ValueError:
                    pass
            kept.append((g.last, ref.last))
    replayed(g)
    assert all(torch.equal(a, b) for a, b in kept)


@check("control_threads")
def _():
    def body(m, x):
        h = m.lin(x)
        m.last = h
        return h
    ref, g = twins(body)
    inputs = xs(200)
    with torch.no_grad():
        want = [ref(x) for x in inputs]
        g(inputs[0])
        g(inputs[0])
    got = {}

    def work(t):
        with torch.no_grad():
            for j in range(t, len(inputs), 4):
                got[j] = g(inputs[j])
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sync()
    replayed(g, 10)
    bad = [j for j in range(len(inputs)) if not torch.equal(got[j], want[j])]
    assert not bad, bad[:10]
    assert len({id(t) for t in got.values()}) == len(inputs)


@check("control_empty_batch")
def _():
    def body(m, x):
        h = m.lin(x)
        m.last = h
        return h, m.e
    ref, g = twins(body)
    ref.e = torch.empty(0, 4, device=DEV)
    g.e = torch.empty(0, 4, device=DEV)

    def post(i, g, og, r, ow):
        assert og[1] is g.e and og[0] is g.last
    all_equal(run(ref, g, xs(rows=0), post))
    replayed(g)


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        h1 = self.lin(x)
        self.last = h1
        h2 = self.b(h1)
        h3 = self.c(h2)
        return h1, h2, h3, h1.t()


@check("control_three_chained_pieces_first_kept")
def _():
    ref, g = twins(Three())

    def post(i, g, og, r, ow):
        assert og[0] is g.last and og[3]._base is og[0] and ow[3]._base is ow[0]
        _write_shows_in_kept(i, g, og[0], r, ow[0])
        og[2].add_(1)
        ow[2].add_(1)
    all_equal(run(ref, g, post=post))
    replayed(g)
    assert cg.stats(g.b).replays >= N - 2 and cg.stats(g.c).replays >= N - 2


fails = [n for n, ok in RESULTS if not ok]
print(f"SUMMARY {len(RESULTS) - len(fails)}/{len(RESULTS)} passed in "
      f"{time.perf_counter() - T0:.1f} s" + (f"; failed: {', '.join(fails)}" if fails else ""))
sys.exit(1 if fails else 0)
