"""Review of 8f10ea2 (``_replay.of_this_call``: outputs of one graph on one memory, handed out
without a copy by ``copy_outputs=False`` and by a ``graph_region`` / a piecewise root's chained
pieces, share this call's version counter, as eager's do: a view in eager is
``o.as_strided(...)`` of this call's first output ``o`` on that memory, a non-view is
``o.detach()`` re-geometried by ``set_`` under ``_unsafe_preserve_version_counter``; another
dtype, conj/neg bits: ``.data``).

``test_finding*`` assert eager's behaviour; they were strict xfails on 8f10ea2, and findings
1-4 are fixed since (every output after the first on a memory is a ``detach()`` of the first
with its own layout, no view of it; another dtype or a bit: a view of such a ``detach()``; an
inference tensor: no counter to keep);
``test_control_*`` are scenarios checked and found right. Every graphed module is compared
with an eager twin (``copy.deepcopy`` before graphify), bitwise, and the counters say that the
graph path ran (``cg.stats(g).replays``).

CPU, simulated backend (fixture ``sim``). GPU twin: .ci/review/counters/gpu_counters.py."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify.api import _state_of

N = 6  # calls per scenario: warm-up, capture, then replays


class Root(nn.Module):
    def __init__(self, body, dtype=None):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=dtype)
        self.body = body

    def forward(self, x):
        return self.body(self, x)


def twins(body, dtype=None, **kw):
    torch.manual_seed(0)
    ref = Root(body, dtype)
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def xs(n=N, dtype=None):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=g, dtype=dtype) for _ in range(n)]


MODES = {"zero_copy": (dict(copy_outputs=False), contextlib.nullcontext),
         "region": ({}, cg.graph_region)}


def _pair(f):
    return lambda m, x: (lambda y: (y, f(y)))(m.lin(x))


# -- finding 1: another dtype / conj view beside its base: a counter of its own -------------

_OTHER = {"conj": (lambda y: y.conj(), torch.cfloat),
          "view_as_real": (torch.view_as_real, torch.cfloat),
          "real": (lambda y: y.real, torch.cfloat),
          "int_view": (lambda y: y.view(torch.int32), torch.float32)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("how", list(_OTHER))
def test_finding1_other_dtype_view_shares_its_base_counter(sim, how, mode):
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


@pytest.mark.parametrize("mode", list(MODES))
def test_finding1_write_to_base_of_saved_conj_output_is_caught(sim, mode):
    kw, scope = MODES[mode]
    ref, g = twins(_pair(lambda y: y.conj()), torch.cfloat, **kw)
    inputs = xs(dtype=torch.cfloat)
    raised = {}
    with scope():
        for name, m in (("graph", g), ("eager", ref)):
            w = torch.ones(4, dtype=torch.cfloat, requires_grad=True)
            with torch.no_grad():
                for x in inputs[:-1]:
                    m(x)
                y, c = m(inputs[-1])
            loss = (c * w).abs().sum()  # (saves c)
            with torch.no_grad():
                y.add_(1)  # (c's base, in eager)
            try:
                loss.backward()
                raised[name] = False
            except RuntimeError as e:
                assert "modified by an inplace operation" in str(e)
                raised[name] = True
    assert cg.stats(g).replays >= 3
    assert raised["eager"]
    assert raised["graph"], "the replay's backward used values written after they were saved"


# -- finding 2: torch.inference_mode(): a non-view output on a view's memory crashes -------

_INF = {"view": lambda y: (y, y[1]),
        "view_first": lambda y: (y[1], y),
        "two_slices": lambda y: (y[0], y[1])}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("how", list(_INF))
def test_finding2_inference_mode_outputs_on_one_memory(sim, how, mode):
    kw, scope = MODES[mode]
    f = _INF[how]
    ref, g = twins(lambda m, x: f(m.lin(x) * 2), **kw)
    with torch.inference_mode(), scope():
        for x in xs():
            og, ow = g(x), ref(x)
            assert all(torch.equal(a, b) for a, b in zip(og, ow))
    assert cg.stats(g).replays >= 3


class Pair(nn.Module):
    """A piece with two outputs on one memory: its region slots are not ``lone``."""

    def __init__(self, how="view"):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        y = self.lin(x)
        if self.how == "view":
            return y, y[0]
        if self.how == "view_first":
            return y[0], y
        if self.how == "t":
            return y, y.t()
        if self.how == "detach":
            return y, y.detach()
        raise AssertionError(self.how)


class PairRoot(nn.Module):
    """Piecewise (a Python side effect, ``self.last = ...``): ``lin`` is its piece."""

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
        if self.how == "ret_both":
            self.last = a
            return a, b
        raise AssertionError(self.how)


def test_finding2_inference_mode_piecewise_root(sim):
    torch.manual_seed(0)
    ref = PairRoot("a")
    g = cg.graphify(copy.deepcopy(ref))
    with torch.inference_mode():
        for x in xs():
            og, ow = g(x), ref(x)
            assert torch.equal(og, ow)
    assert cg.stats(g.lin).replays >= 3


# -- finding 3: a piecewise root keeping its piece's view output: no longer movable ----------

@pytest.mark.parametrize("piece", ["view", "t"])
def test_finding3_kept_view_output_of_a_piece_is_the_output(sim, piece):
    torch.manual_seed(0)
    ref = PairRoot("b", piece)
    g = cg.graphify(copy.deepcopy(ref))
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
    assert not bad, f"calls {bad}: the kept tensor misses a write through the output"
    assert all(s == (True, True) for s in same), same
    assert st.replays >= N - 2, st


# -- finding 4: two outputs whose eager base is no output: the second a view of the first ----

@pytest.mark.parametrize("mode", list(MODES))
def test_finding4_requires_grad_on_one_slice_stays_on_it(sim, mode):
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
    assert got["graph"][:2] == got["eager"][:2], got


# -- controls -------------------------------------------------------------------------------

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


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("how", list(_BODIES))
def test_control_versions_and_values_per_call(sim, how, mode):
    """Each call: values, a write to the last output, every output's version as eager's; in a
    region every result held is compared again at the end (the later replays must not have
    overwritten it)."""
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
                held.append((og[:1], ow[:1]))  # (the first only: holding views blocks)
            del og, ow  # (held while the next call runs, they would block its replay)
        for hg, hw in held:
            assert all(torch.equal(a, b) for a, b in zip(hg, hw))
    assert cg.stats(g).replays >= 4, cg.stats(g)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("how", ["view_first", "three", "two_slices"])
def test_control_write_to_saved_output_of_a_call_is_caught(sim, how, mode):
    """The last output saved for backward, then the first written: eager refuses (they share a
    counter); so does the replay's; an earlier call's saved output is not touched."""
    kw, scope = MODES[mode]
    f = _BODIES[how]
    ref, g = twins(lambda m, x: f(m.lin(x) * 2), **kw)
    inputs = xs()
    with scope():
        for m in (g, ref):
            w = torch.ones(4, requires_grad=True)
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
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss1.backward()
    assert cg.stats(g).replays >= 3


@pytest.mark.parametrize("how", ["a", "a_ret_b", "ret_both"])
@pytest.mark.parametrize("piece", ["view", "view_first", "t", "detach"])
def test_control_piecewise_kept_base(sim, how, piece):
    """Piece returns two outputs on one memory; the root keeps its first: moved every call,
    results held all compared at the end, every call after capture replayed."""
    torch.manual_seed(0)
    ref = PairRoot(how, piece)
    g = cg.graphify(copy.deepcopy(ref))
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
    for lg, lw in res:
        assert all(torch.equal(a, b) for a, b in zip(lg, lw))
    st = cg.stats(g.lin)
    assert st.replays >= N - 2, st
    assert _state_of(g)._chain.moved_outputs == st.replays


@pytest.mark.parametrize("piece", ["view_first", "detach"])
def test_control_piecewise_kept_second_non_view(sim, piece):
    """The root keeps and returns its piece's second output where that is no view (y of
    (y[0], y), y.detach()): moved and returned itself, every call replayed."""
    torch.manual_seed(0)
    ref = PairRoot("b", piece)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i, x in enumerate(xs()):
            og, ow = g(x), ref(x)
            assert torch.equal(og, ow) and og is g.last and ow is ref.last
            og.add_(i + 1)
            ow.add_(i + 1)
            assert torch.equal(g.last, ref.last)
    assert cg.stats(g.lin).replays >= N - 2


@pytest.mark.parametrize("mode", list(MODES))
def test_control_inference_mode_same_geometry_detach(sim, mode):
    """y, y.detach() under inference_mode (no set_ needed): values right, replayed."""
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


@pytest.mark.parametrize("op", ["t_", "resize_", "detach_", "requires_grad_", "set_"])
def test_control_metadata_ops_on_regeometried_output(sim, op):
    """(y[1], y): y is o.detach() re-geometried by set_; a metadata op on it after works as on
    eager's y, the other output (y[1]) keeps its values and version; the next call's outputs
    are unaffected."""
    ref, g = twins(lambda m, x: (lambda y: (y[1], y))(m.lin(x)), copy_outputs=False)
    inputs = xs()
    got = {}
    for name, m in (("graph", g), ("eager", ref)):
        with torch.no_grad():
            for x in inputs[:-2]:
                m(x)
            a, y = m(inputs[-2])
        if op == "set_":
            y.set_(torch.zeros(5))
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
    assert e[:4] == gr[:4]
    assert torch.equal(e[4], gr[4])
    assert all(torch.equal(p, q) for p, q in zip(e[5], gr[5]))
    assert cg.stats(g).replays >= 3
