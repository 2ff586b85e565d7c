"""Review of f9e7252 (a piece's training graph's timed turns count the slow path from
``GraphedState.slow()`` on) and a8abf78 (``_fast.Bypass``: a piecewise root's grad-mode calls
run its pending pieces plain from their ``DirectCall``), by a review helper.

Findings first (F1, F1b, F2a, F2b, F4: each a strict xfail on the code reviewed, a8abf78 and
c7b45d4, which landed during the review; F4 was c7b45d4's own; fixed since, each a test now), then
the controls: the attacks that held. CPU only, through the simulated backend (``sim``): outputs and
gradients are compared with eager's bitwise (``torch.equal``), and where it says so with the
same model graphified with the bypass off (``Bypass.scan`` answering None: each piece through
its own pending fast path, as before a8abf78), which isolates what the commit changed.

Nothing found makes a wrong value: a bypassed piece runs its plain forward, which is what its
own pending decision runs. What the bypass skips is the piece's own look at the call: which
signature it is, under which flags, whether its statics moved. The findings are calls that the
piece's own path would have replayed (or whose move it would have seen), pinned to the plain
forward for as long as some other output stays kept (F1, F2), or for good (F2b, F4), and
counted under a reason that is not theirs (PENDING; F4: the other signature's).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.utils.checkpoint import checkpoint

import cudagraphify as cg
from cudagraphify import _fast
from cudagraphify._engine import PENDING
from cudagraphify._nested import bypassing

from test_pending_bypass import Block, Model, _pieces

STATE = "_cudagraphify_state"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def bypass_off():
    """The commit's switch undone for the calls inside: no root arms a bypass."""
    scan = _fast.Bypass.scan
    _fast.Bypass.scan = staticmethod(lambda state: None)
    try:
        yield
    finally:
        _fast.Bypass.scan = scan


def _armed(g) -> bool:
    fast = g.__dict__[STATE]._fast
    return getattr(fast, "bypass", None) is not None


def _pending_calls(mods) -> int:
    return sum(cg.stats(m).eager_calls.get(PENDING, 0) for m in mods)


def _grads_equal(a, b) -> bool:
    return all((p.grad is None) == (q.grad is None)
               and (p.grad is None or torch.equal(p.grad, q.grad))
               for p, q in zip(a.parameters(), b.parameters()))


def _step(g, ref, *args, back=True):
    o, w = g(*args), ref(*args)
    assert torch.equal(o, w) and o.dtype == w.dtype
    if back:
        o.sum().backward(), w.sum().backward()
        assert _grads_equal(g, ref)
    return o, w


@contextlib.contextmanager
def token_seen(g):
    """Whether ``g``'s blocks (eager parts of Model's root, not pieces) ran under an armed
    token: the attack met the bypass. (Their class's forward: no module write, no epoch bump.)"""
    seen: list[bool] = []
    forward = Block.forward
    mine = {id(m) for m in g.modules() if isinstance(m, Block)}

    def spy(self, x):
        if id(self) in mine:
            seen.append(bypassing.token is not None)
        return forward(self, x)
    Block.forward = spy
    try:
        yield seen
    finally:
        Block.forward = forward


def _settle(g, ref, x, kept: list, calls: int = 8) -> None:
    """Grad-mode calls whose outputs (graphified, eager) are all kept: the pieces' training
    graphs wait for their backward, and the root's bypass is armed."""
    for _ in range(calls):
        kept.append(_step(g, ref, x, back=False))
    assert _armed(g), "no bypass armed"


# -- models ------------------------------------------------------------------------------------


class Trim(nn.Module):
    """A root whose pieces' shapes the data sets: ``.item()`` (a host sync, so the root is
    piecewise) picks how many rows they see (trimming padding by a length read on the host is
    the common case). The root's own arguments keep one shape."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        n = 2 + int((x[0, 0] > 0).item())
        return self.fc(self.ln(x[:n])).sum(0)


def _rows(n: int) -> torch.Tensor:
    x = torch.randn(4, 8)
    x[0, 0] = 1.0 if n == 3 else -1.0
    return x


class Ctx:
    """An argument of a user type with no value semantics: opaque to the signature (as an HF
    DynamicCache, or a batch object): the root runs around it, its submodules are pieces."""

    def __init__(self, scale: float):
        self.scale = scale


class Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x, ctx):
        return self.fc(self.ln(x)) * ctx.scale


def _pair(cls, seed=0):
    torch.manual_seed(seed)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref))


def _opaque_settled():
    """An opaque root planned by an inference call, trained (its pieces' training graphs
    replay), then grad-mode calls whose outputs are kept: its bypass armed."""
    ref, g = _pair(Opaque)
    c, x = Ctx(2.0), torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(g(x, c), ref(x, c))
    assert len(g.__dict__[STATE].pieces) == 2
    for _ in range(4):
        _step(g, ref, x, c)
    assert cg.stats(g.fc).replays >= 2
    kept = [_step(g, ref, x, c, back=False) for _ in range(5)]
    return ref, g, c, x, kept


# -- findings ----------------------------------------------------------------------------------


# F1 (speed, stats). The bypass stands for the piece's own pending fast path, whose first check
# is the call's tensors (their layouts: the signature). The root's fast path checks the root's
# arguments, which do not fix the pieces' (a length read on the host, the reason the root is
# piecewise at all). While the outputs of one of the piece's signatures are kept, its calls with
# another signature, whose training graph is free, run plain instead of replaying it, for as
# long as those outputs live, and are counted under PENDING ("the backward of an earlier call
# with this signature has not run yet"), which is false for them. With the bypass off: 6 of 6
# replayed, none counted pending.
def test_f1_a_piece_of_another_signature_replays_its_free_graph(sim):
    ref, g = _pair(Trim)
    a, b = _rows(3), _rows(2)
    for _ in range(4):
        _step(g, ref, a), _step(g, ref, b)
    kept = [_step(g, ref, a, back=False) for _ in range(4)]  # signature a's graphs wait
    _step(g, ref, b), _step(g, ref, b)
    # (fixed: the pieces' decisions no longer hold for this call; nothing is armed)
    replays, pending = cg.stats(g.fc).replays, _pending_calls([g.fc])
    for _ in range(6):
        _step(g, ref, b)  # (bitwise eager's, gradients too: the values hold)
    assert kept
    assert _pending_calls([g.fc]) == pending, "calls of a free signature counted as pending"
    assert cg.stats(g.fc).replays - replays == 6, "its free graph is not replayed"


def test_f1_control_bypass_off_replays_the_free_graph(sim):
    ref, g = _pair(Trim)
    a, b = _rows(3), _rows(2)
    with bypass_off():
        for _ in range(4):
            _step(g, ref, a), _step(g, ref, b)
        kept = [_step(g, ref, a, back=False) for _ in range(4)]
        _step(g, ref, b), _step(g, ref, b)
        replays, pending = cg.stats(g.fc).replays, _pending_calls([g.fc])
        for _ in range(6):
            _step(g, ref, b)
    assert kept and cg.stats(g.fc).replays - replays == 6
    assert _pending_calls([g.fc]) == pending


# F1b (speed, stats). ``Bypass.scan`` marks every piece whose decision is a pending one as it
# is, without checking it holds now: it snapshots the global state and the flags at the scan,
# not at the pieces' decisions. A scan runs on the root's first fast call after a pending
# decision was made anywhere (``pending_made``): here another module's, made after a flag
# changed. The pieces' decisions are the old flags' (their own path would MISS on the flags and
# graph the new ones); they are armed under the new flags, and every later training step runs
# them plain while the old outputs are kept: 0 replays instead of 36.
def test_f1b_a_scan_under_new_flags_does_not_arm_the_old_flags_pending_pieces(sim):
    ref, g = _pair(Model)
    other = cg.graphify(nn.Linear(8, 8))
    x = torch.randn(3, 8)
    for _ in range(4):
        _step(g, ref, x)
    kept = []
    _settle(g, ref, x, kept)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not was)
    try:
        side = [other(x) for _ in range(8)]  # its kept outputs: a pending decision of its own
        for _ in range(4):
            _step(g, ref, x)
        replays = cg.stats(g).replays
        for _ in range(6):
            _step(g, ref, x)
        assert kept and side
        assert cg.stats(g).replays - replays == 6 * len(_pieces(g)), \
            "the new flags' graphs are not replayed"
    finally:
        torch.use_deterministic_algorithms(was)


# F2a (speed, stats). An opaque root's fast path (``EagerFast.opaque``) checks the types of its
# arguments, not their tensors; the bypass is armed all the same (``self.chained`` is True for
# it). A new shape of the root's own tensor (a last, smaller batch; a new sequence length) keeps
# the pieces on the old shape's pending decision: none of the new shape's graphs replays while
# the old outputs are kept (bypass off: 4 of 4).
def test_f2a_an_opaque_roots_new_shape_is_decided_by_its_pieces(sim):
    ref, g, c, x, kept = _opaque_settled()
    _step(g, ref, x, c, back=False)
    assert not _armed(g)  # (fixed: an opaque argument's decision never arms)
    y = torch.randn(6, 8)
    for _ in range(3):
        _step(g, ref, y, c)
    replays = cg.stats(g.fc).replays
    for _ in range(4):
        _step(g, ref, y, c)
    assert kept
    assert cg.stats(g.fc).replays - replays == 4


# F2b (speed forever, misleading error). Nor does it check the statics: a piece's parameter
# moved by a ``.data`` swap while its output is kept is not seen by the root (it never looks)
# nor by the piece (bypassed): its graph is not released, and the kept output's backward finds
# the parameter moved: "parameters moved ... (FSDP2 ...)", and ``refuse_training``: every later
# training call of the piece runs eagerly, for good. With the bypass off the piece's pending
# fast path sees the move (statics_same), its graph is released, the backward raises "released"
# and training replays again (5 of 6 steps). The same class as review helper-32's
# test_review_pending2 B (which had 7299dd8 reverted). A root that is not opaque is not
# affected (its statics_same sees the move: control below).
def test_f2b_an_opaque_roots_piece_whose_parameter_moved_trains_graphed_again(sim):
    ref, g, c, x, kept = _opaque_settled()
    _step(g, ref, x, c, back=False)
    assert not _armed(g)  # (fixed: an opaque argument's decision never arms)
    for m in (g, ref):
        m.fc.weight.data = m.fc.weight.data.clone()
    _step(g, ref, x, c, back=False)  # (eager's values: plain)
    with pytest.raises(cg.CudagraphifyError):
        sum(o.sum() for o, _ in kept).backward()
    kept.clear()
    g.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    replays = cg.stats(g.fc).replays
    for _ in range(6):
        _step(g, ref, x, c)
    assert g.fc.__dict__[STATE].train_eager is None, g.fc.__dict__[STATE].train_eager
    assert cg.stats(g.fc).replays > replays


@pytest.mark.parametrize("calls", [1, 2])
def test_f2b_control_a_keyed_root_sees_the_move_as_before(sim, calls):
    """A root whose fast path checks its statics: the same outcome with the bypass on and off
    (after one call, the probe's, the pieces have not looked: refused, as before a8abf78;
    after two, released)."""
    seen = []
    for off in (False, True):
        ref, g = _pair(Model)
        x = torch.randn(3, 8)
        with bypass_off() if off else contextlib.nullcontext():
            for _ in range(4):
                _step(g, ref, x)
            kept = []
            for _ in range(6):
                kept.append(_step(g, ref, x, back=False)[0])
            for m in (g, ref):
                m.blocks[0].fc.weight.data = m.blocks[0].fc.weight.data.clone()
            for _ in range(calls):
                _step(g, ref, x, back=False)
            with pytest.raises(cg.CudagraphifyError) as e:
                sum(k.sum() for k in kept).backward()
            kept.clear()
            g.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
            for _ in range(6):
                _step(g, ref, x)
        seen.append(("moved" in str(e.value), g.blocks[0].fc.__dict__[STATE].train_eager))
    assert seen[0] == seen[1], seen


class Syncs(nn.Module):
    """A piece with no submodule whose 3-row signature syncs the host (run eagerly, remembered:
    an EagerEntry of its own) while its 2-row one is graphed."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        y = x @ self.w
        if x.shape[0] == 3:
            y = y * float(y.sum() > -1e30)
        return y


class TrimSyncs(nn.Module):
    def __init__(self):
        super().__init__()
        self.p, self.q = Syncs(), nn.Linear(8, 8)

    def forward(self, x):
        n = 2 + int((x[0, 0] > 0).item())
        return self.q(self.p(x[:n])).sum(0)


# F4 (speed forever, stats; c7b45d4, which landed on main during this review: it marks pieces
# whose decision is any eager one, ``EagerFast.decided``, not only pending ones). F1 without an
# end: a decided eager signature has no ``still`` to run out, so once a piece's last own
# decision is the eager one of signature A, every later call of the root's fast path runs it
# plain, its graphed signature B included, in plain training (forward, backward, no output
# kept), until some module write, flag or give-back moves an epoch; a rescan marks the same
# decision again, since the bypassed piece never decides anew. Its calls are counted under A's
# reason. 0 of 20 replays (bypass off: 20 of 20; a8abf78 itself: 20 of 20).
def test_f4_an_eager_signature_does_not_pin_the_pieces_graphed_one(sim):
    ref, g = _pair(TrimSyncs)
    for _ in range(4):
        _step(g, ref, _rows(2))
    assert cg.stats(g.p).graphs == 1
    for _ in range(3):
        _step(g, ref, _rows(3))  # its eager signature, decided
    eager = dict(cg.stats(g.p).eager_calls)
    replays = cg.stats(g.p).replays
    for _ in range(20):
        _step(g, ref, _rows(2))  # (bitwise eager's, gradients too)
    assert cg.stats(g.p).replays - replays == 20
    assert dict(cg.stats(g.p).eager_calls) == eager, "graphed-signature calls counted eager"


def test_f4_control_bypass_off(sim):
    ref, g = _pair(TrimSyncs)
    with bypass_off():
        for _ in range(4):
            _step(g, ref, _rows(2))
        for _ in range(3):
            _step(g, ref, _rows(3))
        replays = cg.stats(g.p).replays
        for _ in range(20):
            _step(g, ref, _rows(2))
    assert cg.stats(g.p).replays - replays == 20


# -- controls: the bypass's values ---------------------------------------------------------------


@pytest.mark.parametrize("cls", [Model, Trim])
def test_differential_bypass_on_off_and_eager_bitwise(sim, cls):
    """Kept outputs (the bypass armed), then their backward: the values and gradients with the
    bypass on, off, and eager, all bitwise; and the gradients of calls made only while armed
    (every piece plain) bitwise eager's too."""
    torch.manual_seed(0)
    ref = cls()
    on, off = cg.graphify(copy.deepcopy(ref)), cg.graphify(copy.deepcopy(ref))
    # (Trim: the calls that arm it see 3 rows, the later ones 2 and 3 in turn)
    xs = [_rows(3 if i < 11 or i % 2 else 2) for i in range(16)]

    def call(x, back):
        a = on(x)
        with bypass_off():
            b = off(x)
        w = ref(x)
        assert torch.equal(a, w) and torch.equal(b, w)
        if back:
            a.sum().backward(), b.sum().backward(), w.sum().backward()
        return a, b, w

    for x in xs[:5]:
        call(x, True)
    assert _grads_equal(on, ref) and _grads_equal(off, ref)
    first = [call(x, False) for x in xs[5:11]]
    assert _armed(on) and not _armed(off)
    for m in (on, off, ref):
        m.zero_grad(set_to_none=True)
    later = [call(x, False) for x in xs[11:]]  # each piece bypassed (on) or pending (off)
    for i, m in enumerate((on, off, ref)):
        sum(t[i].sum() for t in later).backward()
    assert _grads_equal(on, ref) and _grads_equal(off, ref)
    for i, m in enumerate((on, off, ref)):
        sum(t[i].sum() for t in first).backward()
    assert _grads_equal(on, ref) and _grads_equal(off, ref)


def test_inside_an_explicit_graph_region(sim):
    ref, g = _pair(Model)
    x = torch.randn(3, 8)
    kept = []
    with cg.graph_region():
        for _ in range(4):
            _step(g, ref, x)
        for _ in range(8):
            kept.append(_step(g, ref, x, back=False))
        armed = _armed(g)
        for _ in range(3):
            kept.append(_step(g, ref, x, back=False))
        # (inside it: a region's training graphs go with it when it closes)
        sum(o.sum() for o, _ in kept).backward(), sum(w.sum() for _, w in kept).backward()
        assert _grads_equal(g, ref)
    assert armed  # (the pieces' decisions are the region's: they applied, plain)


class Outer(nn.Module):
    """A root whose forward calls another piecewise root the user graphified on its own: each
    arms its own bypass, the inner one's token put back after its call."""

    def __init__(self):
        super().__init__()
        self.inner = Model()
        self.fc = nn.Linear(8, 8)
        self.seen = []

    def forward(self, x):
        t = torch.tensor([3.0])  # CROSS_DEVICE: the root is piecewise
        token = bypassing.token
        y = self.inner(self.fc(x) * t)
        self.seen.append(bypassing.token is token)
        return self.fc(y)


def test_nested_roots_each_arm_their_own(sim):
    torch.manual_seed(0)
    ref = Outer()
    g = copy.deepcopy(ref)
    cg.graphify(g.inner)
    cg.graphify(g)
    x = torch.randn(3, 8)
    kept = []
    for _ in range(4):
        _step(g, ref, x)
    for _ in range(10):
        kept.append(_step(g, ref, x, back=False))
    assert _armed(g.inner)
    assert all(g.seen)
    sum(o.sum() for o, _ in kept).backward(), sum(w.sum() for _, w in kept).backward()
    assert _grads_equal(g, ref)
    assert bypassing.token is None


class Twin(nn.Module):
    """Two roots that share one block (its pieces are both roots' pieces)."""

    def __init__(self, shared):
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(8, 8)

    def forward(self, x):
        t = torch.tensor([0.5])
        return self.shared(self.own(x) * t)


def test_a_piece_shared_by_two_roots(sim):
    torch.manual_seed(0)
    block = Model(blocks=1)
    r1, r2 = Twin(block), Twin(block)
    ref = copy.deepcopy(nn.ModuleList([r1, r2]))
    g = copy.deepcopy(ref)
    g1, g2 = cg.graphify(g[0]), cg.graphify(g[1])
    x = torch.randn(3, 8)
    kept = []
    for step in range(14):
        back = step < 4
        for gi, ri in ((g1, ref[0]), (g2, ref[1]), (g1, ref[0])):
            kept.append(_step(gi, ri, x, back=back))
            if back:
                kept.pop()
    assert _armed(g1) or _armed(g2)
    sum(o.sum() for o, _ in kept).backward(), sum(w.sum() for _, w in kept).backward()
    assert _grads_equal(g, ref)


def test_share_graph_layers_armed(sim):
    """share_graph layers (each a piecewise root, its pieces shared by the group's layers):
    each layer's bypass armed, the values and gradients eager's."""
    torch.manual_seed(0)
    ref = Model(blocks=3)
    g = copy.deepcopy(ref)
    cg.share_graph(g.blocks)
    x = torch.randn(3, 8)
    for _ in range(5):
        _step(g, ref, x)
    kept = [_step(g, ref, x, back=False) for _ in range(10)]
    assert all(_armed(b) for b in g.blocks)
    sum(o.sum() for o, _ in kept).backward(), sum(w.sum() for _, w in kept).backward()
    assert _grads_equal(g, ref)
    for _ in range(3):
        _step(g, ref, x)


_CHECKPOINT = [False]


class Checkpointed(Model):
    """Its blocks checkpointed (non-reentrant) when a module-level flag says so: switched on
    while the bypass is armed (no module write), the pieces run plain under checkpoint's saved
    tensor hooks, and again in the backward's recomputation."""

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if _CHECKPOINT[0] else b(x)
        return x


def test_non_reentrant_checkpoint_switched_on_while_armed(sim):
    ref, g = _pair(Checkpointed)
    x = torch.randn(3, 8)
    kept = []
    for _ in range(4):
        _step(g, ref, x)
    _settle(g, ref, x, kept)
    _CHECKPOINT[0] = True
    try:
        with token_seen(g) as seen:
            for _ in range(3):
                kept.append(_step(g, ref, x, back=False))
        sum(o.sum() for o, _ in kept).backward(), sum(w.sum() for _, w in kept).backward()
    finally:
        _CHECKPOINT[0] = False
    assert any(seen)
    assert _grads_equal(g, ref)


def test_saved_tensor_hooks_around_an_armed_call(sim):
    ref, g = _pair(Model)
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    more = []
    with torch.autograd.graph.save_on_cpu(), token_seen(g) as seen:
        for _ in range(3):
            more.append(_step(g, ref, x, back=False))
    assert all(seen)
    sum(o.sum() for o, _ in more).backward(), sum(w.sum() for _, w in more).backward()
    assert _grads_equal(g, ref)


def test_forward_ad_through_an_armed_call(sim):
    ref, g = _pair(Model)
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    t = torch.randn(3, 8)
    with fwAD.dual_level(), token_seen(g) as seen:
        a = fwAD.unpack_dual(g(fwAD.make_dual(x, t)))
        b = fwAD.unpack_dual(ref(fwAD.make_dual(x, t)))
    assert torch.equal(a.primal, b.primal) and torch.equal(a.tangent, b.tangent)
    # (the root's fast path does not take a dual tensor, its TensorGuards tell it apart: the
    # pieces' own pending fast paths run them plain, as before a8abf78)
    assert seen == [False, False]


_RAISE = [False]


class Touchy(nn.Linear):
    def forward(self, x):
        if _RAISE[0]:  # (a module-level flag: no module write, the bypass stays armed)
            raise RuntimeError("touchy")
        return super().forward(x)


class TouchyModel(Model):
    def __init__(self):
        super().__init__()
        self.blocks[1].fc2 = Touchy(8, 8)


def test_an_error_in_a_bypassed_pieces_forward(sim):
    ref, g = _pair(TouchyModel)
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    _RAISE[0] = True
    try:
        with pytest.raises(RuntimeError, match="touchy"), token_seen(g) as seen:
            g(x)
    finally:
        _RAISE[0] = False
    assert bypassing.token is None and seen == [True, True]
    kept.append(_step(g, ref, x, back=False))
    sum(o.sum() for o, _ in kept).backward(), sum(w.sum() for _, w in kept).backward()
    assert _grads_equal(g, ref)


def test_ungraphify_from_inside_an_armed_call(sim):
    ref, g = _pair(Model)
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    hooks = g.blocks[0].__dict__["_forward_hooks"]  # (a block: not a piece; no epoch bump)
    hooks[object()] = lambda m, a, o: cg.ungraphify(g) and None
    with token_seen(g) as seen:
        o = g(x)
    hooks.clear()
    # (still armed for the second block, whose pieces' DirectCall finds their proxies gone)
    assert seen == [True, True]
    assert torch.equal(o, ref(x)) and bypassing.token is None
    assert torch.equal(g(x), ref(x))


def test_a_piece_given_back_during_an_armed_call(sim):
    ref, g = _pair(Model)
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    piece = g.blocks[1].fc.__dict__[STATE]

    def give_back(m, a):
        if piece.given_back is None:
            with piece.lock:
                piece.give_back("piece given back: by the review, mid-call")
    g.blocks[1].ln.__dict__["_forward_pre_hooks"][object()] = give_back  # (no epoch bump)
    try:
        with token_seen(g) as seen:
            for _ in range(2):
                kept.append(_step(g, ref, x, back=False))
    finally:
        g.blocks[1].ln.__dict__["_forward_pre_hooks"].clear()
    assert piece.given_back is not None and piece._backward_pending and seen[:2] == [True, True]
    sum(o.sum() for o, _ in kept).backward(), sum(w.sum() for _, w in kept).backward()
    assert _grads_equal(g, ref)


def test_the_kept_outputs_backward_run_from_inside_an_armed_call(sim):
    ref, g = _pair(Model)
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    done = []

    def backward_now():
        if not done:
            done.append(1)
            sum(o.sum() for o, _ in kept).backward()
            sum(w.sum() for _, w in kept).backward()
    hooks = g.blocks[1].__dict__["_forward_pre_hooks"]  # (a block: not a piece)
    hooks[object()] = lambda m, a: backward_now()
    try:
        with token_seen(g) as seen:
            o, w = _step(g, ref, x, back=False)
    finally:
        hooks.clear()
    assert done and _grads_equal(g, ref) and seen == [True, True]
    g.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    o.sum().backward(), w.sum().backward()
    assert _grads_equal(g, ref)
    for _ in range(3):
        _step(g, ref, x)


def test_two_threads_call_the_armed_root(sim):
    ref, g = _pair(Model)
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    want = ref(x)
    outs, errors = [], []

    def run():
        try:
            for _ in range(20):
                outs.append(g(x))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(outs) == 60
    assert all(torch.equal(o, want) for o in outs)


def test_a_given_back_piece_with_a_backward_pending_takes_its_own_path(sim):
    """``DirectCall`` checks ``given_back`` before the token: the graph kept for a pending
    backward is released by the piece's own path once that backward ran."""
    ref, g = _pair(Model)
    x = torch.randn(3, 8)
    kept = []
    _settle(g, ref, x, kept)
    piece = g.blocks[0].fc.__dict__[STATE]
    with piece.lock:
        piece.give_back("piece given back: by the review")
    assert piece._backward_pending
    for _ in range(2):
        kept.append(_step(g, ref, x, back=False))
    sum(o.sum() for o, _ in kept).backward(), sum(w.sum() for _, w in kept).backward()
    assert _grads_equal(g, ref)
    _step(g, ref, x)
    assert not piece._backward_pending and cg.stats(g.blocks[0].fc).graphs == 0


# -- controls: the trial's slow-path stamp (f9e7252) -----------------------------------------------


from test_trial import _COST, _HOST, _NOW, _Root  # noqa: E402
from test_trial_training import _train, timed  # noqa: E402,F401


def _idle_between_calls(seconds: float):
    """Host (and device) time passing between calls, outside any of them."""
    def idle(m, args):
        _NOW[0] += seconds
        _HOST[0] += seconds
    return idle


def test_trial_a_stale_stamp_is_never_counted(timed):
    """Every call restamps at ``slow()``: time between calls (here 1 s before each of the
    root's forwards) is not a later graph turn's decision."""
    _COST.update(graph=5e-6, eager=10e-6)
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    g.register_forward_pre_hook(_idle_between_calls(1.0))  # (the root's: before its pieces)
    _train(g, ref, steps=12)
    state = g.a._cudagraphify_state
    assert state.given_back is None, state.given_back
    assert cg.stats(g.a).graphs == 1


def test_trial_an_eager_turn_that_takes_long_leaves_no_stamp_behind(timed):
    """A piece's eager turn (its slow() never reaches ``_timed_replay``) that spends 1 s in its
    forward: the next graph turn counts from its own slow()."""
    _COST.update(graph=5e-6, eager=10e-6)
    ref, g = _pair(_Root)
    piece_forward = type(g.a).forward

    def forward(self, x):
        if torch.is_grad_enabled() and self is g.a:
            _HOST[0] += 1.0  # (on the host only: the device clock is the trial's end to end)
        return piece_forward(self, x)
    type(g.a).forward = forward
    try:
        _train(g, ref, steps=12)
    finally:
        type(g.a).forward = piece_forward
    assert g.a._cudagraphify_state.given_back is None
