"""Review of fast-grad2 (6d1d94d, cec1945, b6cc670): the settled counter of ``_fast.Bypass``,
``EagerFast.lone`` / ``_chained``'s grad-mode shortcut, and ``_engine._settle_waiting_trials``
(b6cc670: withdrawn after the GPU run, which made Llama's grad-mode step slower: the tests of
W1 and W2, which were about it, went with it).

CPU, on the simulated backend (``sim``) and its clocked variant (``timed``: a piece's eager
forward costs ``_COST['eager']``, a graph replay ``_COST['graph']``). Every output (and
gradient, where a backward runs) compared with eager's bitwise.

Findings (strict xfails on the reviewed code; fixed since, plain tests now):

- W1 (cost, for good; b6cc670): a keep verdict taken on ONE sample of each kind is final: the
  trial is dropped (``entry.trial = None``), the second graph captured beside it is untimed,
  and grad mode has no plan trial (``_chained`` returns plain under grad), so nothing judges
  the piece again. One slow eager sample (a cold first eager run after the capture: the
  allocator growing, a GC pass) keeps a graph 3x slower than eager, and two pools for it. A
  full trial (min of 3 each) gives it back. Hits ordinary gradient accumulation with 3
  micro-batches too, not only the bench's kept output.
- W2 (cost; b6cc670): the early verdict is taken even where ``_another_in_flight`` then
  refuses the second graph (max_graphs full; a shared policy; another owner's entry): the
  trial is ended on one pair and nothing is bought with it (the call still runs eagerly).
- W3 (loud; pre-existing, reached sooner by b6cc670): a later signature's capture evicts a
  training graph that is waiting for its backward (``GraphCache.put`` evicts by LRU, pending
  or not); the kept output's backward then raises "released before the backward ran". With
  b6cc670, the second graph of the signature is made on the 6th call instead of after a full
  trial, so ``max_graphs=2`` + one other signature + kept outputs raises where fast-grad2^
  ran. The same after a full trial raises on fast-grad2^ too (W3b).
- W4 (cost, for good; 6d1d94d): ``Bypass.scan`` reads ``_training.settled`` AFTER asking
  each piece's ``holds()``: a pending call that settles in between (its autograd graph freed
  by a GC pass or another thread) is counted into the snapshot although the piece was marked
  as pending. The bypass then stays valid with every piece marked, none of them runs its own
  path again, so no graph of theirs makes a context whose end would move the count: the
  pieces run eagerly for good (10 training steps with backward: 0 replays). Before 6d1d94d,
  ``valid`` asked ``still()`` on every root call and healed.

Controls (plain tests): ``lone`` answers as ``fits`` (kwargs, extra args, zero args, a tensor
subclass, other shape/dtype/stride/requires_grad); the grad-mode shortcut of ``_chained``;
kept-output / backward transitions of the settled counter (backward, retain_graph,
autograd.grad of another input, output dropped); gradient accumulation over 2 and 3 forwards
with the early keep, compared with eager; the give-back direction still waits.
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _fast, _trial, _training
from cudagraphify._engine import PENDING

from test_trial import _COST, _NOW, _Root
from test_trial_training import timed  # noqa: F401 - the fixture (clocked simulated backend)

STATE = "_cudagraphify_state"
GIVE_BACK = dict(graph=30e-6, eager=10e-6)  # the graph 3x slower than eager
KEEP = dict(graph=5e-6, eager=50e-6)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def cold_first_eager(monkeypatch):
    """The first eager sample of each trial costs 40 µs more (a cold first eager run after
    the capture); every later one costs what ``_COST`` says."""
    timed_ = _trial.Trial.timed

    def timed(self, run, eager):
        if eager and not self.eager:
            def slow():
                _NOW[0] += 40e-6
                return run()
            return timed_(self, slow, eager)
        return timed_(self, run, eager)
    monkeypatch.setattr(_trial.Trial, "timed", timed)


def _pair(cls=_Root, **kw):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def _state(g):
    return g.a.__dict__[STATE]


def _grads_equal(g, ref) -> bool:
    for p, q in zip(g.parameters(), ref.parameters()):
        if (p.grad is None) != (q.grad is None):
            return False
        if p.grad is not None and not torch.equal(p.grad, q.grad):
            return False
    return True


def _step(g, ref, c: str, kept: list, rows: int = 4) -> None:
    """``k`` keeps the output (no backward), ``d`` drops it, ``b`` runs its backward."""
    x = torch.randn(rows, 8)
    o, w = g(x), ref(x)
    assert torch.equal(o, w)
    if c == "k":
        kept.append((o, w))
    elif c == "b":
        o.sum().backward(), w.sum().backward()
        assert _grads_equal(g, ref)


def _bench_then_train(g, ref) -> None:
    """The bench's grad-mode step (the 5th call's output kept for a while), then the outputs
    dropped and 12 training steps."""
    kept: list = []
    for c in "ddddk" + "ddd":
        _step(g, ref, c, kept)
    kept.clear()
    for _ in range(12):
        _step(g, ref, "b", kept)


# -- W1 --------------------------------------------------------------------------------------

def _accumulate(g, ref, micro: int, steps: int = 12) -> None:
    og = torch.optim.SGD(g.parameters(), lr=0.01)
    orf = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(steps):
        lg = lr = 0
        for _ in range(micro):
            x = torch.randn(4, 8)
            o, w = g(x), ref(x)
            assert torch.equal(o, w), step
            lg, lr = lg + o.sum(), lr + w.sum()
        lg.backward(), lr.backward()
        assert _grads_equal(g, ref), step
        og.step(), orf.step(), og.zero_grad(), orf.zero_grad()


# -- W2 --------------------------------------------------------------------------------------

# -- W3 --------------------------------------------------------------------------------------

def _kept_then_other_signature(g, ref, warm: str) -> None:
    kept: list = []
    for c in warm:
        _step(g, ref, c, kept)
    _step(g, ref, "k", kept)          # the graph replays: its backward waits
    _step(g, ref, "k", kept)          # b6cc670: a second graph of the signature
    _step(g, ref, "k", kept, rows=2)  # another signature: seen once
    _step(g, ref, "k", kept, rows=2)  # captured: evicts the least recently used graph
    sum(o.sum() for o, _ in kept).backward()
    sum(w.sum() for _, w in kept).backward()
    assert _grads_equal(g, ref)


# (fixed) finding W3b (loud, pre-existing): after a full trial the same eviction of a pending
# graph raises on fast-grad2^ too (GraphCache.put evicts pending training graphs)
def test_w3b_after_a_full_trial_pre_existing(timed, monkeypatch):
    _COST.update(KEEP)
    ref, g = _pair(max_graphs=2)
    _kept_then_other_signature(g, ref, "b" * 12)


# -- W4 --------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        t = torch.tensor([2.0])  # CROSS_DEVICE: the block runs eagerly, its children are pieces
        return x + self.fc2(self.fc(self.ln(x))) * t


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _pieces(g) -> list:
    return [m.__dict__[STATE] for m in g.__dict__[STATE].pieces]


def _armed(g, ref, x, kept):
    for _ in range(8):
        o, w = g(x), ref(x)
        assert torch.equal(o, w)
        kept.append(o)
    root = g.__dict__[STATE]
    assert root._fast is not None and root._fast.bypass is not None


def _scan_with_death(g, ref, x, kept, monkeypatch, in_window: bool) -> int:
    """The root scans its pieces again (another eager decision was made somewhere); the kept
    outputs' autograd graph dies during the scan, right after the last piece was asked
    (``in_window``), or just before the scan. Then 10 training steps: the pieces' replays."""
    n = len(_pieces(g))
    holds, asked = _fast.EagerFast.holds, [0]

    def late(self):
        r = holds(self)
        asked[0] += 1
        if asked[0] == n and in_window:
            kept.clear()  # (a GC pass, or another thread dropping them)
            gc.collect()
        return r
    monkeypatch.setattr(_fast.EagerFast, "holds", late)
    if not in_window:
        kept.clear()
    _fast.decided_made[0] += 1
    o = g(x)
    assert torch.equal(o, ref(x))
    del o
    monkeypatch.setattr(_fast.EagerFast, "holds", holds)
    assert not any(e.pending() for st in _pieces(g) for e in st.cache.graphs(st))
    replays = cg.stats(g).replays
    for _ in range(10):
        o, w = g(x), ref(x)
        assert torch.equal(o, w)
        o.sum().backward(), w.sum().backward()
        assert _grads_equal(g, ref)
    return cg.stats(g).replays - replays


# (fixed) finding W4 (cost, for good): Bypass.scan reads the settled count after asking the
# pieces: a settle in between is swallowed, and the pieces never replay again
def test_w4_a_settle_during_the_scan_keeps_the_pieces_eager_for_good(sim, monkeypatch):
    torch.manual_seed(0)
    ref = Model()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 8)
    kept: list = []
    _armed(g, ref, x, kept)
    assert _scan_with_death(g, ref, x, kept, monkeypatch, in_window=True) > 0


def test_w4_control_a_settle_before_the_scan(sim, monkeypatch):
    torch.manual_seed(0)
    ref = Model()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 8)
    kept: list = []
    _armed(g, ref, x, kept)
    assert _scan_with_death(g, ref, x, kept, monkeypatch, in_window=False) >= 10 * 6 - 6


# -- controls: the settled counter ------------------------------------------------------------

def _replays_next(g, ref, x) -> int:
    r = cg.stats(g).replays
    o, w = g(x), ref(x)
    assert torch.equal(o, w)
    return cg.stats(g).replays - r


@pytest.mark.parametrize("how", ["backward", "retain_graph", "autograd_grad_input", "drop",
                                 "autograd_grad_param"])
def test_control_each_settle_ends_the_bypass(sim, how):
    torch.manual_seed(0)
    ref = Model()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 8)
    kept: list = []
    _armed(g, ref, x, kept)
    before = _training.settled[0]
    total = sum(o.sum() for o in kept)
    if how == "backward":
        total.backward()
    elif how == "retain_graph":
        total.backward(retain_graph=True)
    elif how == "autograd_grad_param":
        torch.autograd.grad(total, [g.blocks[0].fc.weight])
    elif how == "autograd_grad_input":
        # (no piece's backward is needed: the autograd graph is freed, its contexts die)
        xi = torch.randn(3, 8, requires_grad=True)
        torch.autograd.grad(total + xi.sum(), [xi])
    del total
    kept.clear()
    gc.collect()
    assert _training.settled[0] != before
    assert not g.__dict__[STATE]._fast.bypass.valid()
    assert _replays_next(g, ref, x) == 6


def test_control_retain_graph_kept_outputs_then_second_backward_is_loud_or_equal(sim):
    # the retained autograd graph of kept outputs: the pieces replay again once its backward
    # ran (settled); a second backward through it after a replay raises (gen moved), never
    # silently wrong
    torch.manual_seed(0)
    ref = Model()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 8)
    kept: list = []
    _armed(g, ref, x, kept)
    total = sum(o.sum() for o in kept)
    total.backward(retain_graph=True)
    assert _replays_next(g, ref, x) == 6
    g.zero_grad()
    with pytest.raises(cg.CudagraphifyError):
        total.backward()


# -- controls: lone == fits -------------------------------------------------------------------

class _Sub(torch.Tensor):
    pass


def _decision(t):
    ref = Model()
    g = cg.graphify(copy.deepcopy(ref))
    g(t)  # make the root's state
    root = g.__dict__[STATE]
    return _fast.EagerFast.decided(root, None, _Entry(), (t,), {})


class _Entry:
    reason, state, pieces = "x", None, None


@pytest.mark.parametrize("other", [
    "same", "shape", "dtype", "stride", "grad", "sub", "param"])
def test_control_lone_answers_as_fits(sim, other):
    t = torch.randn(3, 8)
    d = _decision(t)
    assert d is not None and d.lone is not None
    u = {"same": torch.randn(3, 8), "shape": torch.randn(4, 8),
         "dtype": torch.randn(3, 8, dtype=torch.float64),
         "stride": torch.randn(8, 3).t(), "grad": torch.randn(3, 8, requires_grad=True),
         "sub": torch.randn(3, 8).as_subclass(_Sub),
         "param": nn.Parameter(torch.randn(3, 8))}[other]
    assert d.lone(u) == d.fits((u,), {}), other


def test_control_lone_only_for_one_positional_tensor(sim):
    t = torch.randn(3, 8)
    ref = Model()
    g = cg.graphify(copy.deepcopy(ref))
    g(t)
    root = g.__dict__[STATE]
    mk = _fast.EagerFast.decided
    assert mk(root, None, _Entry(), (), {"x": t}).lone is None
    assert mk(root, None, _Entry(), (t, 3), {}).lone is None
    assert mk(root, None, _Entry(), (t, t), {}) is None  # (a tensor passed twice: none)
    assert mk(root, None, _Entry(), (t, t.clone()), {}).lone is None
    assert mk(root, None, _Entry(), (t.as_subclass(_Sub),), {}) is None
    d = mk(root, None, _Entry(), (t,), {})
    # the DirectCall asks lone only for one positional argument and no keyword
    assert d.fits((t,), {"y": 1}) is False and d.fits((), {}) is False
    assert d.fits((t, t), {}) is False


class _KwBlock(Block):
    """Calls its first piece positionally or by keyword, by a flag outside any module (not
    watched: the root's bypass stays armed across the switch)."""
    mode = ["pos"]

    def forward(self, x):
        t = torch.tensor([2.0])
        h = self.ln(x) if self.mode[0] == "pos" else self.ln(input=x)
        return x + self.fc2(self.fc(h)) * t


class _KwModel(Model):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_KwBlock() for _ in range(2))


def test_control_bypassed_piece_called_by_keyword_is_decided_by_its_own_path(sim):
    torch.manual_seed(0)
    ref = _KwModel()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 8)
    kept: list = []
    _armed(g, ref, x, kept)
    _KwBlock.mode[0] = "kw"
    try:
        for _ in range(4):
            o, w = g(x), ref(x)
            assert torch.equal(o, w)
            kept.append(o)
        sum(o.sum() for o in kept).backward()  # (raises nothing; grads compared elsewhere)
    finally:
        _KwBlock.mode[0] = "pos"


# -- controls: the early keep, outputs and gradients -----------------------------------------

