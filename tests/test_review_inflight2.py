"""Second review of the in-flight training graphs (d62294e) and of its fixes, 31e55a3 and
2661480, the latter's version-counter replay above all: ``FirstCall.warm_up`` measures how far
the real (first, eager) call moves the version counters of the "watchable" statics, the entry
keeps (tensor, n) pairs as ``TrainingGraph.written``, each training replay moves them as much,
and ``_GraphedFunction.forward`` takes ``ctx.versions`` of ``saved_statics`` after the replay.

CPU, on the simulated backend (``sim``, tests/conftest.py). Every check runs the same calls on an
eager copy and on the graphed module, and compares raise / no-raise (an "inplace" RuntimeError)
and values bitwise (``torch.equal``).

Findings (each failed on 2661480; R1-R3 fixed by the commit after it, which measures the version
moves over the capture's run and takes the buffers of modules first met in a call as written
where the probe saw them written; R4 and R5 remain, strict xfail):

- R1 (raise where eager succeeds; regression of 2661480): ``written`` is measured on the real
  call, not on the run the graph holds. A forward whose first call writes a buffer that later
  calls do not (a lazy initialisation guarded by a Python flag, the capture's run taking the
  other path) gets a graph whose every replay moves that buffer's version: another signature's
  pending backward that saved the buffer raises "modified by an inplace operation", eagerly none.
- R2 (silent where eager raises; pre-existing, not covered by the fix): the same forward, the
  other way round: the buffer the later calls (and the graph) write is not in ``written`` of the
  graph captured on the first call, whose replay therefore leaves its version alone; a pending
  backward that saved it runs silently where eager raises.
- R3 (wrong values; pre-existing): a module outside the graphed module's tree (reached through a
  plain dict, a closure) is adopted by ``statics.adopt`` only after ``watchable`` was taken, so a
  buffer it writes in forward is neither restored after the training extra warm-up (it is written
  twice on the first call) nor kept at its version across the capture (the first call's own
  backward raises where eager's does not). The graph computes from the doubly written buffer for
  good.
- R4 (silent where eager raises): ``written`` and ``saved_statics`` hold the tensor objects of
  the capture. A buffer rebound to another tensor object on the same memory with a version counter
  of its own (``m.scale = m.scale.data``) keeps the graph (same addresses) but the replay moves,
  and the backward checks, the old object's counter: the second graph (captured after the rebind)
  moves the new one, so the first graph's backward reads a buffer its twin overwrote, silently.
- R5 (cosmetic): a buffer registered together with a view of itself (both watchable, one version
  counter): the replay moves the shared counter once per entry, twice as far as eager. No raise
  differs (any move raises), but ``_version`` does.

Controls (pass): buffer written then saved in one forward; ``.data`` writes (no version move),
``.detach()`` writes (move); frozen parameter and trainable parameter written under no_grad in
forward; tied buffers; ``load_state_dict(assign=True)``; a buffer rebound to new memory;
``num_warmup_iters=3``; BatchNorm in train and eval with several forwards per backward; a piece of
a piecewise plan writing a saved buffer. GPU side: .ci/review/inflight2/run_all.sh.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _outcome(fn) -> str:
    """"ok", "inplace" (autograd's version check), or another error's type."""
    try:
        fn()
        return "ok"
    except RuntimeError as e:
        return "inplace" if "inplace operation" in str(e) else f"RuntimeError: {e}"[:200]
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:200]


def _twins(make, *, prep=None, warm=(3,), warm_backward=True, **kw):
    torch.manual_seed(0)
    ref = make()
    g = make()
    g.load_state_dict(ref.state_dict())
    if hasattr(g, "sync_from"):  # (state kept outside the module: a twin of its own)
        g.sync_from(ref)
    g = cg.graphify(g, **kw)
    for n in warm:
        x = torch.randn(n, 4)
        seen = [_outcome(lambda m=m: m(x).sum().backward() if warm_backward else m(x))
                for m in (ref, g)]
        assert seen[0] == seen[1], ("first calls", n, seen)
        ref.zero_grad(), g.zero_grad()
    if prep is not None:
        prep(ref), prep(g)
    return ref, g


def _step(m, xs):
    """Forwards of ``xs`` in turn, then one backward of their sum: (outcome, outputs, grads)."""
    outs = []

    def go():
        total = 0
        for x in xs:
            o = m(x)
            outs.append(o)
            total = total + o.sum()
        total.backward()

    res = _outcome(go)
    grads = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    return res, outs, grads


def _same_as_eager(ref, g, shapes, steps=3, extra=None, before=None):
    """``steps`` steps of ``_step`` on both twins: outcome, outputs, gradients and buffers
    alike (bitwise); ``before(m)`` runs on each first, ``extra(ref, g, step)`` checks more."""
    for step in range(steps):
        if before is not None:
            before(ref), before(g)
        xs = [torch.randn(n, 4) for n in shapes]
        r, w, gr = _step(ref, xs)
        o, v, gg = _step(g, xs)
        assert r == o, (step, "eager:", r, "graphed:", o)
        assert len(w) == len(v) and all(torch.equal(a, b) for a, b in zip(w, v)), step
        if r == "ok":
            assert all((a is None) == (b is None) and (a is None or torch.equal(a, b))
                       for a, b in zip(gr, gg)), step
        for (n, a), b in zip(ref.named_buffers(), g.buffers()):
            assert torch.equal(a, b), (step, n)
        if extra is not None:
            extra(ref, g, step)
    return g


# -- modules ------------------------------------------------------------------------------------

class _Scaled(nn.Module):
    """Writes a buffer in forward, then autograd saves it (``mul``'s other operand)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        self.scale.mul_(0.5)
        return self.lin(x) * self.scale


class _FirstCallWrites(nn.Module):
    """The first call writes ``scale``, later calls ``tmp`` (the same op, ``out=`` another buffer:
    the probe sees one op sequence); ``saved`` names the buffer autograd saves."""

    def __init__(self, saved: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.zeros(4))
        self.register_buffer("tmp", torch.zeros(4))
        self.ready = False
        self.saved = saved

    def forward(self, x):
        torch.add(self.scale, 0.5, out=self.tmp if self.ready else self.scale)
        self.ready = True
        return self.lin(x) * getattr(self, self.saved)


_SIDE: dict[int, nn.Module] = {}


class _Side(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, h):
        self.scale.mul_(0.5)
        return h * self.scale


class _Outer(nn.Module):
    """Runs a module outside its own tree (held in a plain dict: no child)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _SIDE[id(self)] = _Side()

    def side(self) -> nn.Module:
        return _SIDE[id(self)]

    def forward(self, x):
        return self.side()(self.lin(x))

    def load_state_dict(self, sd, *a, **kw):  # (with the outside module's buffer)
        _SIDE[id(self)].scale.copy_(_SIDE[next(k for k in _SIDE if k != id(self))].scale)
        return super().load_state_dict(sd, *a, **kw)


class _ViewBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("base", torch.ones(8))
        self.register_buffer("lo", self.base[:4])

    def forward(self, x):
        self.lo.mul_(0.5)
        return self.lin(x) * self.base[4:]


# -- R1 / R2 --------------------------------------------------------------------------------------

def test_r1_a_write_only_the_first_call_made_is_replayed_as_a_version_move(sim):
    ref, g = _twins(lambda: _FirstCallWrites("scale"), warm=(3, 5), warm_backward=False)
    _same_as_eager(ref, g, (5, 3))  # eager: ok (scale is written on the first call only)


def test_r2_a_write_the_first_call_did_not_make_moves_no_version(sim):
    ref, g = _twins(lambda: _FirstCallWrites("tmp"), warm=(3, 5), warm_backward=False)
    _same_as_eager(ref, g, (5, 3))  # eager: inplace (tmp written by the call of shape 3)


def test_r1_control_the_same_module_in_one_order(sim):
    ref, g = _twins(lambda: _FirstCallWrites("scale"), warm=(3, 5), warm_backward=False)
    _same_as_eager(ref, g, (3, 5))


# -- R3 ---------------------------------------------------------------------------------------------

def test_r3_an_outside_modules_buffer_is_written_twice_by_the_first_call(sim):
    torch.manual_seed(0)
    ref = _Outer()
    g = cg.graphify(_Outer())
    g.load_state_dict(ref.state_dict())
    for step in range(3):
        x = torch.randn(3, 4)
        w, o = ref(x), g(x)
        assert torch.equal(ref.side().scale, g.side().scale), step
        assert torch.equal(w, o), step


def test_r3_the_first_calls_backward_raises_where_eager_does_not(sim):
    torch.manual_seed(0)
    ref = _Outer()
    g = cg.graphify(_Outer())
    g.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4)
    assert _outcome(lambda: g(x).sum().backward()) == _outcome(lambda: ref(x).sum().backward())


# -- R4 ---------------------------------------------------------------------------------------------

def _rebind_data(m):
    m.scale = m.scale.data  # the same memory, a version counter of its own


def test_r4_a_buffer_rebound_on_the_same_memory_keeps_a_stale_written(sim):
    ref, g = _twins(_Scaled, prep=_rebind_data)
    _same_as_eager(ref, g, (3, 3))  # eager: inplace


def test_r4_control_rebound_before_the_first_call(sim):
    ref, g = _twins(_Scaled, warm=(), prep=_rebind_data)
    _same_as_eager(ref, g, (3, 3))


def test_r4_control_rebound_to_new_memory(sim):
    def fresh(m):
        m.scale = m.scale.clone()
    ref, g = _twins(_Scaled, prep=fresh)
    _same_as_eager(ref, g, (3, 3))


def test_r4_control_load_state_dict_assign(sim):
    ref, g = _twins(_Scaled, prep=lambda m: m.load_state_dict(m.state_dict(), assign=True))
    _same_as_eager(ref, g, (3, 3))


# -- R5 ---------------------------------------------------------------------------------------------

def test_r5_a_view_buffer_moves_its_counter_twice(sim):
    ref, g = _twins(_ViewBuffer)
    _same_as_eager(ref, g, (3,), steps=2)  # (values and raises agree)
    moves = []
    for m in (ref, g):
        v = m.base._version
        m(torch.randn(3, 4)).sum().backward()
        moves.append(m.base._version - v)
    assert moves[0] == moves[1], moves


def test_r5_control_view_buffer_raises_as_eager(sim):
    ref, g = _twins(_ViewBuffer)
    _same_as_eager(ref, g, (3, 3))
    _same_as_eager(ref, g, (3, 5))


# -- controls ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [(3,), (3, 3), (3, 5), (5, 3), (3, 3, 3)])
def test_written_then_saved_in_one_forward(sim, shapes):
    ref, g = _twins(_Scaled, warm=(3, 5))
    _same_as_eager(ref, g, shapes)


@pytest.mark.parametrize("shapes", [(3,), (3, 3), (3, 5)])
def test_num_warmup_iters_three(sim, shapes):
    ref, g = _twins(_Scaled, warm=(3, 5), num_warmup_iters=3)
    _same_as_eager(ref, g, shapes)


class _DataWrite(_Scaled):
    def forward(self, x):
        self.scale.data.mul_(0.5)  # no version move eagerly
        return self.lin(x) * self.scale


class _DetachWrite(_Scaled):
    def forward(self, x):
        self.scale.detach().mul_(0.5)  # the same counter: moves it
        return self.lin(x) * self.scale


class _FrozenWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fz = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.fz.mul_(0.5)
        return self.lin(x) * self.fz


class _ClampTrainable(nn.Module):
    """A trainable weight written under no_grad before use (saved at its new version)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.b.weight.clamp_(-0.3, 0.3)
        return self.b(torch.relu(self.a(x)))


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Scaled(), _Scaled()
        self.b.scale = self.a.scale

    def forward(self, x):
        return self.b(self.a(x))


class _ReadOnlyTwice(nn.Module):
    """Two modules share one buffer; one writes it before both read it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Scaled(), nn.Linear(4, 4)
        self.b.register_buffer("scale", self.a.scale)

    def forward(self, x):
        return self.b(self.a(x)) * self.b.scale


@pytest.mark.parametrize("make", [_DataWrite, _DetachWrite, _FrozenWrite, _ClampTrainable,
                                  _Tied, _ReadOnlyTwice],
                         ids=["data", "detach", "frozen", "clamp", "tied", "shared"])
@pytest.mark.parametrize("shapes", [(3,), (3, 3), (3, 5)])
def test_in_place_writes_of_statics(sim, make, shapes):
    ref, g = _twins(make, warm=(3, 5))
    _same_as_eager(ref, g, shapes)


def _bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("shapes", [(6,), (6, 6), (6, 6, 6), (6, 7)])
def test_batchnorm_forwards_per_backward(sim, train, shapes):
    def make():
        m = _bn()
        return m.train(train)
    ref, g = _twins(make, warm=(6, 7))
    _same_as_eager(ref, g, shapes)


class _PieceRoot(nn.Module):
    """A host sync in the root: piecewise; the child that writes a saved buffer is a piece."""

    def __init__(self):
        super().__init__()
        self.s = _Scaled()
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = self.s(x)
        if bool((y > -1e9).all()):
            y = y + 1
        return self.b(y)


@pytest.mark.parametrize("shapes", [(3,), (3, 3), (3, 5), (5, 3)])
def test_a_piece_that_writes_a_saved_buffer(sim, shapes):
    ref, g = _twins(_PieceRoot, warm=(3, 5))
    _same_as_eager(ref, g, shapes, steps=4)
