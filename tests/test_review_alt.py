"""Review of 67e0e31 (the replay path kept aside: ``GraphedState._alt`` / ``other_fast``).

The question: a ``Fast`` now survives slow-path calls of its own state for another signature;
what can such a call change that the kept ``Fast`` assumes did not change? Each control below
drives two (or three) signatures in turn through a graphified module and its eager twin and
compares every output bitwise (CPU double, ``sim``), across the changes a slow call for the
other signature can make: a rescan, an invalidation, an eviction, a recapture, a region's
slots and their capture order, outputs handed out without a copy, threads, nesting, grad mode,
static states (HF ``StaticCache``, ``generate``). No finding reproduced on the CPU double: all
are plain tests (controls); the GPU-only risks are in ``.ci/review/alt/gpu_alt.py``.
"""

from __future__ import annotations

import contextlib

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine
from cudagraphify._fast import MISS

from test_other_fast import slow_calls  # noqa: F401 (a fixture)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("shift", torch.zeros(8))

    def forward(self, x):
        return torch.relu(self.lin(x)) + self.shift


def _pair(cls=_M, **kw):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


_SH = ((3, 8), (5, 8))


def _alt_replays(g) -> bool:
    """Whether the kept-aside path is in use on ``g`` (a Fast kept aside)."""
    return type(g._cudagraphify_state._alt).__name__ == "Fast"


# -- regions: slots handed out as aliases, capture order -----------------------------------------

def test_control_region_outputs_held_across_the_other_signature(sim, slow_calls):  # noqa: F811
    """Outputs (aliases of region slots) kept across calls of the other signature: each
    replay protects the slots captured at or after it (the kept path walks them as the slow
    path does)."""
    ref, g = _pair()
    kept = []
    with torch.no_grad(), cg.graph_region():
        for i in range(14):
            x = torch.randn(*_SH[i % 2])
            kept.append((g(x), ref(x)))
            if i == 5:
                before = slow_calls[0]
            for o, r in kept:
                assert torch.equal(o, r), i
        assert slow_calls[0] - before <= 1  # (the kept path did take the calls)


def test_control_region_views_held_block_and_stay_equal(sim):
    ref, g = _pair()
    kept = []
    with torch.no_grad(), cg.graph_region():
        for i in range(12):
            x = torch.randn(*_SH[i % 2])
            kept.append((g(x)[1:], ref(x)[1:]))  # (a view: cannot be moved, blocks)
            for o, r in kept:
                assert torch.equal(o, r), i


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _M(), _M()


def test_control_region_chain_of_two_graphed_modules_two_signatures(sim):
    """m1 -> m2 chained in a region (m2 reads m1's slot in place, ``borrowed``), with two
    signatures in turn, m2 sometimes fed m1's older output (a borrowed slot's other alias)."""
    torch.manual_seed(0)
    ref = _Two()
    g = copy.deepcopy(ref)
    g1, g2 = cg.graphify(g.a), cg.graphify(g.b)
    olds = {}
    with torch.no_grad(), cg.graph_region():
        for i in range(16):
            s = i % 2
            x = torch.randn(*_SH[s])
            h, rh = g1(x), ref.a(x)
            assert torch.equal(h, rh)
            feed = olds.get(s, (h, rh)) if i % 3 == 0 else (h, rh)
            assert torch.equal(g2(feed[0]), ref.b(feed[1])), i
            olds[s] = (h, rh)


# -- outputs handed out without a copy, the static state, static arguments ---------------------

def test_control_copy_outputs_false_the_other_signature_leaves_outputs_alone(sim):
    ref, g = _pair(copy_outputs=False)
    prev = {}
    with torch.no_grad():
        for i in range(12):
            s = i % 2
            x = torch.randn(*_SH[s])
            out, r = g(x), ref(x)
            assert torch.equal(out, r)
            other = prev.get(1 - s)
            if other is not None:  # (held until its own signature's next replay)
                assert torch.equal(*other), i
            prev[s] = (out, r)


def test_control_static_argnames_written_between_turns(sim):
    class S(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, table):
            return self.lin(x) + table

    ref, g = _pair(S, static_argnames=("table",))
    t = torch.zeros(8)
    with torch.no_grad():
        for i in range(12):
            t.add_(1.0)
            x = torch.randn(*_SH[i % 2])
            assert torch.equal(g(x, table=t), ref(x, table=t)), i
            if i == 6:
                t = torch.zeros(8)  # (another object: another key, the kept path misses)


# -- what a slow call of the other signature changes ---------------------------------------------

def test_control_eviction_of_the_kept_aside_graph(sim):
    """max_graphs=2 with three signatures: the other signature's capture evicts the kept
    path's graph (released: ``raw`` is None, its check misses)."""
    ref, g = _pair(max_graphs=2)
    shapes = ((3, 8), (5, 8), (7, 8))
    with torch.no_grad():
        for i in range(30):
            x = torch.randn(*(shapes[(i // 2) % 3] if i % 2 else shapes[0]))
            assert torch.equal(g(x), ref(x)), i


def test_control_parameter_moves_and_in_place_writes_between_turns(sim):
    ref, g = _pair()
    with torch.no_grad():
        for i in range(20):
            if i in (7, 12):
                for m in (ref, g):
                    m.lin.weight.data = m.lin.weight.data.clone() * 1.5
            if i == 15:
                for m in (ref, g):
                    m.lin.weight.data.mul_(0.5)
            x = torch.randn(*_SH[i % 2])
            assert torch.equal(g(x), ref(x)), i


def test_control_train_eval_switch_between_turns(sim):
    class D(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.bn = nn.BatchNorm1d(8)

        def forward(self, x):
            return self.bn(self.lin(x))

    ref, g = _pair(D)
    with torch.no_grad():
        for i in range(20):
            if i == 9:
                ref.eval()
                g.eval()
            x = torch.randn(*_SH[i % 2])
            assert torch.equal(g(x), ref(x)), i
            assert torch.equal(g.bn.running_mean, ref.bn.running_mean), i


def test_control_grad_mode_training_signature_between_inference_turns(sim):
    ref, g = _pair()
    for i in range(12):
        x = torch.randn(*_SH[i % 2])
        if i % 3:
            with torch.no_grad():
                assert torch.equal(g(x), ref(x)), i
        else:
            o, r = g(x), ref(x)
            assert torch.equal(o, r), i
            o.sum().backward()
            r.sum().backward()
            assert torch.equal(g.lin.weight.grad, ref.lin.weight.grad), i


def test_control_a_global_hook_between_turns(sim):
    ref, g = _pair()
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(*_SH[i % 2])
            assert torch.equal(g(x), ref(x))
        h = nn.modules.module.register_module_forward_hook(lambda m, a, o: o * 2)
        try:
            for i in range(4):
                x = torch.randn(*_SH[i % 2])
                assert torch.equal(g(x), ref(x)), i
        finally:
            h.remove()
        for i in range(4):
            x = torch.randn(*_SH[i % 2])
            assert torch.equal(g(x), ref(x)), i


def test_control_kept_aside_path_off_matches_on(sim, monkeypatch):
    """The same sequence with the kept path off (the slow path decides each turn)."""
    outs = []
    for on in (True, False):
        if not on:
            monkeypatch.setattr(_engine.GraphedState, "other_fast",
                                lambda self, fn, a, k: MISS)
        ref, g = _pair()
        torch.manual_seed(3)
        got = []
        with torch.no_grad():
            for i in range(10):
                got.append(g(torch.randn(*_SH[i % 2])))
        outs.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


# -- threads, nesting -----------------------------------------------------------------------------

def _two_threads(g, ref, calls: int, region: bool) -> list:
    """Two threads, one signature each, every output compared with eager's: the mismatches."""
    errs = []

    def run(s):
        try:
            with torch.no_grad(), (cg.graph_region() if region else contextlib.nullcontext()):
                for i in range(calls):
                    x = torch.randn(*_SH[s])
                    if not torch.equal(g(x), ref(x)):
                        errs.append((s, i))
        except Exception as e:  # noqa: BLE001
            errs.append(repr(e))

    ts = [threading.Thread(target=run, args=(s,)) for s in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errs


def test_control_two_threads_two_signatures(sim):
    ref, g = _pair()
    with torch.no_grad():
        for i in range(4):
            g(torch.randn(*_SH[i % 2]))
    errs = _two_threads(g, ref, 300, region=False)
    assert not errs, errs[:5]


def test_control_two_threads_two_signatures_in_a_region(sim):
    ref, g = _pair()
    errs = _two_threads(g, ref, 100, region=True)
    assert not errs, errs[:5]


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = cg.graphify(_M())
        self.post = nn.Linear(8, 8)

    def forward(self, x):
        return self.post(self.inner(x))


def test_control_nested_graphified_modules_two_signatures(sim):
    torch.manual_seed(0)
    ref = _Outer()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(*_SH[i % 2])
            assert torch.equal(g(x), ref(x))
            y = torch.randn(*_SH[(i + 1) % 2])
            assert torch.equal(g.inner(y), ref.inner(y))
