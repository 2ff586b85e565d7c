"""Review of a50fefe "a second training graph shares its busy twin's trial"
(_engine._another_in_flight no longer looks at trials, _record_graph(trial_of=...), _judge
clears the shared trial on every graph of the key, defers a give-back while another graph of
the key waits for its backward, and discards every graph of the key on a per-signature
give-back).

CPU, the simulated backend with test_trial's fake clocks (``timed`` fixture of
test_trial_training): a piece's eager forward costs ``_COST["eager"]``, a replay
``_COST["graph"]``.

Findings (tests that failed on a50fefe; fixed since: a give-back is no longer deferred, a graph
whose backward is still to run is held back out of the cache and released once it ran, and
only the graphs sharing the trial go with the verdict):
- T1 (speed, regression): the deferred give-back never comes while, at each of the trial's
  eager turns, the other graph of the signature is pending. The differential bench's pattern
  (each output kept until the next call returns) and a single output kept (a logged loss)
  both do that: the piece is timed forever (every call synchronises the device, half of them
  replay a graph slower than eager). Before the change: given back after 3 timed calls.
- T2 (speed, regression): a per-signature give-back discards every graph of the key, also
  those that do not share the judged trial (another guard's graph, which won its own trial):
  it is captured and timed again.
Controls (plain tests): the keep verdict in the bench pattern, accumulation over several
forwards with either verdict, random interleavings (keep/drop/backward/autograd.grad with
retain_graph/no_grad/eviction/invalidation), threads, ungraphify under a pending twin.
GPU side: .ci/review/sharedtrial/run_all.sh.
"""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from torch import nn

import cudagraphify as cg
from test_trial import _COST, _HOST, _NOW, _Root
from test_trial_training import timed  # noqa: F401 - the fixture (clocked simulated backend)

GIVE_BACK = dict(graph=30e-6, eager=10e-6)
KEEP = dict(graph=5e-6, eager=50e-6)


def _pair(cls=_Root, **kw):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def _grads_equal(g, ref):
    for p, q in zip(g.parameters(), ref.parameters()):
        if (p.grad is None) != (q.grad is None):
            return False
        if p.grad is not None and not torch.equal(p.grad, q.grad):
            return False
    return True


def _state(m):
    return m.__dict__["_cudagraphify_state"]


def _on_trial(st):
    return [e for e in st.cache.graphs() if getattr(e, "trial", None) is not None]


def _bench_pattern(g, ref, calls):
    """Grad-mode calls, each output kept until the next call returns (no backward)."""
    kept = None
    with torch.enable_grad():
        for i in range(calls):
            x = torch.randn(4, 8)
            out, want = g(x), ref(x)
            assert torch.equal(out, want), i
            kept = out  # noqa: F841 - held over the next call
    return kept


def _no_grad_calls(g, ref, n, shape=(2, 8)):
    with torch.no_grad():
        for _ in range(n):
            x = torch.randn(*shape)
            assert torch.equal(g(x), ref(x))


# -- T1 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("other_signature", [False, True], ids=["whole_piece", "signature"])
def test_T1_bench_pattern_give_back_verdict_comes(timed, other_signature):
    _COST.update(GIVE_BACK)
    ref, g = _pair()
    if other_signature:  # (a no_grad graph of the piece too: a per-signature give-back)
        _COST.update(graph=5e-6, eager=50e-6)
        _no_grad_calls(g, ref, 10)
        _COST.update(GIVE_BACK)
    _bench_pattern(g, ref, 60)
    for piece in (g.a, g.b):
        st = _state(piece)
        timed_calls = st.timed_calls - (3 if other_signature else 0)
        assert not _on_trial(st), "still on trial after 60 calls"
        assert timed_calls <= 6, timed_calls  # (before the change: 3)


def test_T1_one_output_kept_give_back_verdict_comes(timed):
    _COST.update(GIVE_BACK)
    ref, g = _pair()
    with torch.enable_grad():
        for _ in range(2):  # (the root's warm-up, the pieces' captures: not held)
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
        x0 = torch.randn(4, 8)
        logged, want0 = g(x0), ref(x0)  # kept, its backward not run (yet)
        assert any(e.pending() for e in _state(g.a).cache.graphs())
        for i in range(40):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), i
        st = _state(g.a)
        try:
            # (before the change: 3 timed calls, then every call eager behind the kept
            # output, untimed; now: a timed call (a device synchronisation) every other call)
            assert st.timed_calls <= 6, (st.timed_calls, len(_on_trial(st)))
        finally:
            logged.sum().backward(), want0.sum().backward()
    assert _grads_equal(g, ref)


def test_T1_control_the_verdict_comes_once_no_twin_is_pending(timed):
    """The deferral itself ends once the pattern drops its outputs (values, gradients eager's)."""
    _COST.update(GIVE_BACK)
    ref, g = _pair()
    kept = _bench_pattern(g, ref, 20)
    del kept
    with torch.enable_grad():
        for i in range(6):
            x = torch.randn(4, 8)
            o, w = g(x), ref(x)
            assert torch.equal(o, w)
            o.sum().backward(), w.sum().backward()
            assert _grads_equal(g, ref), i
    for piece in (g.a, g.b):
        assert _state(piece).given_back is not None


# -- T2 ---------------------------------------------------------------------------------------

class _KPiece(nn.Linear):
    """Reads a Python attribute (a guard): k=0 its eager run costs 50 µs (a graph at 20
    pays), k=1 10 µs (it does not)."""

    def __init__(self):
        super().__init__(8, 8)
        self.k = 0

    def forward(self, x):
        c = 50e-6 if self.k == 0 else 10e-6
        _NOW[0] += c
        _HOST[0] += c
        return super().forward(x) * (self.k + 1)


class _KRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _KPiece(), _KPiece()

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):
            y = y + 1
        return self.b(y)


def test_T2_per_signature_give_back_keeps_another_guards_graph(timed):
    _COST.update(graph=20e-6, eager=0.0)
    ref, g = _pair(_KRoot)

    def calls(n, shape, k):
        for m in (g, ref):
            m.a.k = k
        _no_grad_calls(g, ref, n, shape)

    calls(10, (2, 8), 0)  # another signature with a graph: the give-back is per signature
    calls(10, (4, 8), 0)  # k=0's graph wins its trial
    st = _state(g.a)
    calls(10, (4, 8), 1)  # k=1's graph loses its own: "signature run eagerly"
    assert any(r.startswith("signature run eagerly") for r in st.eager_calls), st.eager_calls
    captures, timed_calls = st.captures, st.timed_calls
    calls(10, (4, 8), 0)  # k=0's graph, kept, replays (before the change: it does)
    assert (st.captures, st.timed_calls) == (captures, timed_calls), \
        (st.captures - captures, st.timed_calls - timed_calls)


# -- controls ---------------------------------------------------------------------------------

def test_keep_verdict_in_bench_pattern_clears_the_shared_trial(timed):
    _COST.update(KEEP)
    ref, g = _pair()
    kept = _bench_pattern(g, ref, 30)
    want = None
    for piece in (g.a, g.b):
        st = _state(piece)
        assert st.given_back is None and st.captures == 2 and not _on_trial(st), st
        assert not any("has not run yet" in r for r in st.eager_calls), st.eager_calls
    del kept, want


@pytest.mark.parametrize("costs", [GIVE_BACK, KEEP], ids=["give_back", "keep"])
@pytest.mark.parametrize("micro", [2, 3, 4])
def test_accumulation_with_shared_trial(timed, costs, micro):
    _COST.update(costs)
    ref, g = _pair()
    og, orf = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(14):
        lg = lr = 0
        for _ in range(micro):
            x = torch.randn(4, 8)
            o, w = g(x), ref(x)
            assert torch.equal(o, w), step
            lg, lr = lg + o.sum(), lr + w.sum()
        lg.backward(), lr.backward()
        assert _grads_equal(g, ref), step
        og.step(), orf.step(), og.zero_grad(), orf.zero_grad()
    for piece in (g.a, g.b):
        st = _state(piece)
        assert (st.given_back is None) == (costs is KEEP), st.given_back
        assert not _on_trial(st)


def test_twin_evicted_while_sharing_the_trial(timed):
    """max_graphs=3: a third signature evicts a twin that shares the trial (not pending):
    values equal; the trial goes on with the other graph and ends."""
    _COST.update(KEEP)
    ref, g = _pair(max_graphs=3)
    with torch.enable_grad():
        x = torch.randn(4, 8)
        o1, w1 = g(x), ref(x)
        x = torch.randn(4, 8)
        o2, w2 = g(x), ref(x)  # the twin (shares the trial)
        o1.sum().backward(), w1.sum().backward()
        for shape in ((2, 8), (3, 8), (5, 8)):
            for _ in range(3):
                x = torch.randn(*shape)
                assert torch.equal(g(x), ref(x))
        o2.sum().backward(), w2.sum().backward()  # (raises if its graph was evicted)
    assert _grads_equal(g, ref)
    _bench_pattern(g, ref, 12)


def test_invalidation_while_sharing(timed):
    _COST.update(GIVE_BACK)
    ref, g = _pair()
    _bench_pattern(g, ref, 5)
    with torch.no_grad():
        w = torch.randn(8, 8)
    for m in (g, ref):
        m.a.weight = nn.Parameter(w.clone())
    _bench_pattern(g, ref, 5)
    with torch.enable_grad():
        for _ in range(8):
            x = torch.randn(4, 8)
            o, r = g(x), ref(x)
            assert torch.equal(o, r)
            o.sum().backward(), r.sum().backward()
            assert _grads_equal(g, ref)


def test_ungraphify_with_a_pending_twin(timed):
    _COST.update(KEEP)
    ref, g = _pair()
    with torch.enable_grad():
        x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
        o1, w1 = g(x1), ref(x1)
        o2, w2 = g(x2), ref(x2)
        cg.ungraphify(g)
        (o1.sum() + o2.sum()).backward(), (w1.sum() + w2.sum()).backward()
    assert _grads_equal(g, ref)


def test_retain_graph_autograd_grad_is_equal_or_raises(timed):
    """autograd.grad twice through kept outputs (retain_graph): each gradient is eager's, or
    the call raises (a graphed call keeps no activations for a second backward); never a
    different value."""
    _COST.update(GIVE_BACK)
    ref, g = _pair()
    for i in range(10):
        with torch.enable_grad():
            xs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
            xr = [x.detach().clone().requires_grad_() for x in xs]
            outs, wants = [g(x) for x in xs], [ref(x) for x in xr]
            for _ in range(2):
                for o, w, x, y in zip(outs, wants, xs, xr):
                    want = torch.autograd.grad(w.sum(), [y], retain_graph=True)[0]
                    try:
                        got = torch.autograd.grad(o.sum(), [x], retain_graph=True)[0]
                    except cg.CudagraphifyError:
                        continue
                    assert torch.equal(got, want), i
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))


def test_threads_keep_outputs_while_another_calls(timed):
    """One thread keeps outputs (pending) while another calls the piece in grad mode; each
    input gradient is eager's."""
    _COST.update(GIVE_BACK)
    ref, g = _pair()
    errors = []

    def worker(seed, hold):
        try:
            gen = torch.Generator().manual_seed(seed)
            kept = []
            for i in range(15):
                x = torch.randn(4, 8, generator=gen, requires_grad=True)
                y = x.detach().clone().requires_grad_()
                with torch.enable_grad():
                    o, w = g(x), ref(y)
                if not torch.equal(o, w):
                    errors.append((seed, i, "value"))
                kept.append((o, w, x, y))
                if len(kept) > hold:
                    o, w, x, y = kept.pop(0)
                    a = torch.autograd.grad(o.sum(), [x])[0]
                    b = torch.autograd.grad(w.sum(), [y])[0]
                    if not torch.equal(a, b):
                        errors.append((seed, i, "grad"))
        except Exception as e:  # noqa: BLE001
            errors.append((seed, repr(e)))

    threads = [threading.Thread(target=worker, args=(s, h)) for s, h in ((1, 3), (2, 0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("seed", range(60))
def test_random_interleavings(timed, seed):
    """Grad-mode calls kept or dropped, backward/autograd.grad (retain_graph) in any order,
    no_grad calls, three shapes, max_graphs 2/3/16, parameters reassigned: every value and
    gradient is eager's; the only error is the documented one (a backward whose graph an
    eviction or invalidation released)."""
    rng = random.Random(seed)
    _COST.update(rng.choice([GIVE_BACK, KEEP]))
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref), max_graphs=rng.choice([2, 3, 16]))
    shapes, kept = [(4, 8), (2, 8), (3, 8)], []

    def clear():
        for m in (g, ref):
            for p in m.parameters():
                p.grad = None

    for i in range(80):
        op = rng.random()
        if op < 0.45:
            x = torch.randn(*rng.choice(shapes), requires_grad=rng.random() < 0.3)
            xr = x.detach().clone().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out, want = g(x), ref(xr)
            assert torch.equal(out, want), i
            if rng.random() < 0.6:
                kept.append((out, want, x, xr))
        elif op < 0.7 and kept:
            out, want, x, xr = kept.pop(rng.randrange(len(kept)))
            try:
                if x.requires_grad and rng.random() < 0.5:
                    r = rng.random() < 0.5
                    gw = torch.autograd.grad(want.sum(), [xr], retain_graph=r)
                    gg = torch.autograd.grad(out.sum(), [x], retain_graph=r)
                    assert torch.equal(gg[0], gw[0]), i
                else:
                    out.sum().backward()
                    want.sum().backward()
                    assert _grads_equal(g, ref), i
            except cg.CudagraphifyError as e:
                assert "released" in str(e), e
                clear()
        elif op < 0.8:
            _no_grad_calls(g, ref, 1, rng.choice(shapes))
        elif op < 0.85 and kept:
            kept.pop(rng.randrange(len(kept)))  # dropped without its backward
        elif op < 0.87:
            with torch.no_grad():
                w = torch.randn(8, 8)
            for m in (g, ref):
                m.a.weight = nn.Parameter(w.clone())
        elif op < 0.9:
            clear()
