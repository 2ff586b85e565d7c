"""Version counters of the tensors a graph writes and autograd saves (cudagraphify/_versions.py).

After each call every version counter the user can see has moved as eager's would, and a
backward raises "modified by an inplace operation" exactly where eager's does:

- a parameter or buffer rebound to another tensor object on the same memory (``m.b =
  m.b.data``, ``m._buffers[...] = ...``, a frozen parameter made anew) keeps its graphs, whose
  replays move, and whose backwards check, the object the user holds now; a backward pending
  across the rebinding checks the object its forward saved, as eager's does;
- tensors that share one counter (a buffer and a view of it, a ``detach()``) have it moved
  once per write, not once per tensor, and a rebinding that changes which share one makes the
  graph captured again;
- a training graph's backward checks the statics whose counter a tensor autograd saved shares
  (not one registered as a view of another's ``.data``: a counter of its own);
- an inference graph's replay (``no_grad``, ``inference_mode``, the fast path too) moves the
  counters of what it writes, as a training graph's does.

CPU, on the simulated backend (``sim``, tests/conftest.py); each check compares with an eager
twin (outcome, outputs, gradients, buffers bitwise, and ``_version``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._fast import Fast
from cudagraphify.api import _state_of
from test_review_inflight2 import (_FrozenWrite, _PieceRoot, _Scaled, _Tied, _ViewBuffer,
                                   _outcome, _same_as_eager, _twins)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _same_versions(ref, g, *names):
    """An ``extra`` for ``_same_as_eager``: the named tensors' versions are eager's. Set to
    eager's first (``load_state_dict`` in ``_twins`` moved the graphed twin's)."""
    for name in names:
        _set_version(_get(g, name), _get(ref, name)._version)

    def check(ref, g, step):
        for name in names:
            a, b = _get(ref, name), _get(g, name)
            assert a._version == b._version, (step, name, a._version, b._version)
    return check


def _set_version(t, version):
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


def _get(m, path):
    for part in path.split("."):
        m = getattr(m, part)
    return m


def _replays(g) -> int:
    return cg.stats(g).replays


# -- modules ------------------------------------------------------------------------------------

class _ReadsFrozen(nn.Module):
    """Autograd saves a frozen parameter forward only reads (``mul``'s other operand)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fz = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        return self.lin(x) * self.fz


class _Held(nn.Module):
    """Writes a tensor kept as a plain attribute (no buffer; large enough not to be guarded by
    value as a CPU scalar is), then autograd saves it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = torch.ones(100)

    def forward(self, x):
        self.acc.mul_(0.5)
        return self.lin(x) * self.acc[:4]

    def sync_from(self, other):
        self.acc = other.acc.clone()


class _DetachTied(nn.Module):
    """Two buffers over one memory with one counter (``detach()``), both written."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Scaled(), _Scaled()
        self.b.scale = self.a.scale.detach()

    def forward(self, x):
        return self.b(self.a(x))


class _DetachPair(nn.Module):
    """A buffer and a ``detach()`` of it (one counter), both written, then the first saved."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("a", torch.ones(4))
        self.register_buffer("b", self.a.detach())

    def forward(self, x):
        self.a.mul_(0.5)
        self.b.mul_(0.5)
        return self.lin(x) * self.a


class _DataView(nn.Module):
    """A buffer registered as a view of another's ``.data``: one memory, two counters; forward
    writes the view and autograd saves the other half of the base (through a view of it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("base", torch.ones(8))
        self.register_buffer("lo", self.base.data[:4])

    def forward(self, x):
        self.lo.mul_(0.5)
        return self.lin(x) * self.base[4:]


def _frozen_anew(m):
    m.fz = nn.Parameter(m.fz.data, requires_grad=False)  # the same memory, a counter of its own


def _through_dict(m):
    m._buffers["scale"] = m.scale.data


def _rebind_data(m):
    m.scale = m.scale.data


# -- rebound on the same memory (R4 and what it reaches) ------------------------------------------

@pytest.mark.parametrize("shapes", [(3, 3), (3,), (3, 5)])
def test_a_frozen_parameter_written_in_forward_rebound(sim, shapes):
    ref, g = _twins(_FrozenWrite, warm=(3, 5), prep=_frozen_anew)
    _same_as_eager(ref, g, shapes, extra=_same_versions(ref, g, "fz"))


@pytest.mark.parametrize("shapes", [(3, 3), (3, 5)])
def test_a_buffer_rebound_through_the_buffers_dict(sim, shapes):
    ref, g = _twins(_Scaled, warm=(3, 5), prep=_through_dict)
    _same_as_eager(ref, g, shapes, extra=_same_versions(ref, g, "scale"))


def test_the_versions_of_a_rebound_buffer_move_as_eagers(sim):
    ref, g = _twins(_Scaled, warm=(3,), prep=_rebind_data)
    _same_as_eager(ref, g, (3,), steps=3, extra=_same_versions(ref, g, "scale"))
    for m in (ref, g):
        with torch.no_grad():
            m(torch.randn(3, 4))
    assert ref.scale._version == g.scale._version
    assert _replays(g) >= 3


def _write_between(ref, g, write, shapes=(3,), steps=3):
    """Forwards of ``shapes``, then ``write(m)``, then the backward: eager's outcome."""
    for step in range(steps):
        xs = [torch.randn(n, 4) for n in shapes]
        seen = []
        for m in (ref, g):
            def go(m=m):
                total = sum(m(x).sum() for x in xs)
                write(m)
                total.backward()
            seen.append(_outcome(go))
            m.zero_grad()
        assert seen[0] == seen[1], (step, "eager:", seen[0], "graphed:", seen[1])


def test_a_saved_frozen_parameter_rebound_then_written_before_backward(sim):
    """Eager saves the frozen parameter the user holds now; writing it before backward
    raises. The graph captured before the rebinding must check that object, not its own."""
    ref, g = _twins(_ReadsFrozen, warm=(3,), prep=_frozen_anew)

    def write(m):
        with torch.no_grad():
            m.fz.mul_(2)
    _write_between(ref, g, write)
    assert _replays(g) >= 3


def test_a_written_buffer_rebound_then_written_by_the_user_before_backward(sim):
    ref, g = _twins(_Scaled, warm=(3, 5), prep=_rebind_data)

    def write(m):
        with torch.no_grad():
            m.scale.add_(1)
    _write_between(ref, g, write, shapes=(3,))
    _write_between(ref, g, write, shapes=(5, 3))


def test_control_rebound_between_forward_and_backward(sim):
    """The backward of a forward made before the rebinding checks the object that forward
    saved (eager's autograd keeps that one): a write through the new object, a counter of its
    own, raises neither way."""
    ref, g = _twins(_ReadsFrozen, warm=(3,))
    for step in range(3):
        x = torch.randn(3, 4)
        seen = []
        for m in (ref, g):
            def go(m=m):
                out = m(x)
                _frozen_anew(m)
                with torch.no_grad():
                    m.fz.mul_(1.5)
                out.sum().backward()
            seen.append(_outcome(go))
            m.zero_grad()
        assert seen[0] == seen[1] == "ok", (step, seen)
        assert torch.equal(ref.fz, g.fz)


def test_control_rebound_between_two_forwards(sim):
    """A forward, the rebinding, a second forward (writing the new object), one backward:
    the first forward's saved object is the old one, whose counter nothing moved since."""
    ref, g = _twins(_Scaled, warm=(3,))
    for step in range(3):
        xs = [torch.randn(3, 4) for _ in range(2)]
        seen, grads = [], []
        for m in (ref, g):
            def go(m=m):
                total = m(xs[0]).sum()
                _rebind_data(m)
                (total + m(xs[1]).sum()).backward()
            seen.append(_outcome(go))
            grads.append([p.grad.clone() for p in m.parameters()])
            m.zero_grad()
        assert seen[0] == seen[1] == "ok", (step, seen)
        assert all(torch.equal(a, b) for a, b in zip(*grads)), step
        assert torch.equal(ref.scale, g.scale), step


def test_load_state_dict_assign_of_the_same_memory_with_counters_of_their_own(sim):
    def load(m):
        m.load_state_dict({k: v.data for k, v in m.state_dict().items()}, assign=True)
    ref, g = _twins(_Scaled, warm=(3, 5), prep=load)
    _same_as_eager(ref, g, (3, 3), extra=_same_versions(ref, g, "scale"))
    _same_as_eager(ref, g, (3, 5), extra=_same_versions(ref, g, "scale"))


def test_a_rebound_buffer_of_a_piece(sim):
    """Piecewise (a control): the piece that writes and saves the buffer read it as a module
    attribute, which its guard holds by identity: rebound, it is captured again."""
    def rebind(m):
        m.s.scale = m.s.scale.data
    ref, g = _twins(_PieceRoot, warm=(3, 5), prep=rebind)
    _same_as_eager(ref, g, (3, 3), steps=3, extra=_same_versions(ref, g, "s.scale"))
    _same_as_eager(ref, g, (3,), steps=3, extra=_same_versions(ref, g, "s.scale"))


def test_a_rebound_buffer_in_training_inside_a_graph_region(sim):
    ref, g = _twins(_Scaled, warm=(), prep=None)
    check = _same_versions(ref, g, "scale")
    with cg.graph_region():
        _same_as_eager(ref, g, (3,), steps=2, extra=check)
        _rebind_data(ref), _rebind_data(g)
        _same_as_eager(ref, g, (3,), steps=3, extra=check)
        _same_as_eager(ref, g, (3, 3), steps=2, extra=check)


@pytest.mark.parametrize("shapes", [(3, 5), (5, 3), (3, 3, 5)])
def test_two_signatures_share_a_rebound_buffer(sim, shapes):
    """Each signature's graph finds the new object on its own next replay."""
    ref, g = _twins(_Scaled, warm=(3, 5), prep=_rebind_data)
    _same_as_eager(ref, g, shapes, extra=_same_versions(ref, g, "scale"))


def test_rebound_twice(sim):
    ref, g = _twins(_Scaled, warm=(3, 5), prep=_rebind_data)
    _same_as_eager(ref, g, (3, 5), steps=2, extra=_same_versions(ref, g, "scale"))
    _rebind_data(ref), _rebind_data(g)
    _same_as_eager(ref, g, (3, 3), steps=2, extra=_same_versions(ref, g, "scale"))


def test_a_tied_buffer_rebound_in_one_of_its_modules(sim):
    """``b.scale`` was ``a.scale``: rebound in ``b`` alone, they are two objects (two
    counters) now: the graphs are captured again."""
    def untie(m):
        m.b.scale = m.b.scale.data
    ref, g = _twins(_Tied, warm=(3, 5), prep=untie)
    _same_as_eager(ref, g, (3, 3), extra=_same_versions(ref, g, "a.scale", "b.scale"))
    _same_as_eager(ref, g, (3, 5), extra=_same_versions(ref, g, "a.scale", "b.scale"))


def test_a_rebound_buffer_in_a_graph_region(sim):
    ref, g = _twins(_Scaled, warm=())
    check = _same_versions(ref, g, "scale")
    with torch.no_grad(), cg.graph_region():
        for step in range(5):
            if step == 2:
                _rebind_data(ref), _rebind_data(g)
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), g(x).clone()), step
            check(ref, g, step)
    assert _replays(g) >= 2


# -- one counter, several tensors (R5 and what it reaches) ---------------------------------------

@pytest.mark.parametrize("shapes", [(3,), (3, 3)])
def test_two_buffers_that_share_one_counter_through_detach(sim, shapes):
    ref, g = _twins(_DetachPair, warm=(3, 5))
    _same_as_eager(ref, g, shapes, extra=_same_versions(ref, g, "a", "b"))
    assert _replays(g) >= 3


def test_a_view_buffers_base_rebound_is_captured_again(sim):
    """``base`` rebound to its ``.data``: ``lo`` keeps the old counter, ``base`` has a new one
    that forward no longer moves: what the first capture measured (one counter moved once)
    fits neither."""
    ref, g = _twins(_ViewBuffer, warm=(3, 5))
    _same_as_eager(ref, g, (3,), extra=_same_versions(ref, g, "base", "lo"))

    def rebind(m):
        m.base = m.base.data
    rebind(ref), rebind(g)
    captures = cg.stats(g).captures
    _same_as_eager(ref, g, (3,), steps=2, extra=_same_versions(ref, g, "base", "lo"))
    _same_as_eager(ref, g, (3, 3), steps=2, extra=_same_versions(ref, g, "base", "lo"))
    assert cg.stats(g).captures > captures


def test_a_view_buffer_in_no_grad_calls(sim):
    ref, g = _twins(_ViewBuffer, warm=(3,), warm_backward=False)
    check = _same_versions(ref, g, "base", "lo")
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), g(x))
            check(ref, g, step)
    assert _replays(g) >= 3


@pytest.mark.parametrize("shapes", [(3,), (3, 3), (3, 5)])
def test_a_view_of_the_data_written_besides_a_saved_base(sim, shapes):
    """``lo`` (a view of ``base.data``: a counter of its own) written, ``base`` saved: eager
    raises for neither a second forward nor a replay."""
    ref, g = _twins(_DataView, warm=(3, 5))
    _same_as_eager(ref, g, shapes, extra=_same_versions(ref, g, "base", "lo"))


# -- inference graphs move counters too -----------------------------------------------------------

@pytest.mark.parametrize("make", [_Scaled, _Held, _FrozenWrite], ids=["buffer", "held", "frozen"])
def test_a_no_grad_call_between_forward_and_backward(sim, make):
    """The no_grad call replays an inference graph that writes what the pending backward
    saved: eager's backward raises."""
    ref, g = _twins(make, warm=(3,))
    for m in (ref, g):
        with torch.no_grad():
            m(torch.randn(3, 4))
    replays = _replays(g)

    def write(m):
        with torch.no_grad():
            m(torch.randn(3, 4))
    _write_between(ref, g, write)
    assert _replays(g) >= replays + 6  # (both calls of each step replayed)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("make, name", [(_Scaled, "scale"), (_Held, "acc"),
                                        (_FrozenWrite, "fz"), (_DetachTied, "a.scale"),
                                        (_DetachPair, "a"), (_ViewBuffer, "base")],
                         ids=["buffer", "held", "frozen", "detach", "pair", "view"])
def test_inference_replays_move_versions_as_eagers(sim, mode, make, name):
    ref, g = _twins(make, warm=())
    check = _same_versions(ref, g, name)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for step in range(5):
        x = torch.randn(3, 4)
        with ctx():
            assert torch.equal(ref(x), g(x)), step
        check(ref, g, step)
    assert _replays(g) >= 3


def test_a_held_tensors_writer_keeps_the_fast_path(sim):
    """An inference graph that writes a plain tensor attribute replays on the fast path, which
    moves its counter too."""
    ref, g = _twins(_Held, warm=())
    check = _same_versions(ref, g, "acc")
    with torch.no_grad():
        for step in range(5):
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), g(x)), step
            check(ref, g, step)
    assert type(_state_of(g)._fast) is Fast


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(4))

    def forward(self, x):
        self.steps.add_(1)
        return self.lin(x) + self.steps


def test_share_graph_layers_that_write_a_buffer(sim):
    """Sharing is refused (they write a buffer): each layer's own graph moves its counter."""
    torch.manual_seed(0)
    ref = nn.ModuleList([_Layer() for _ in range(3)])
    g = nn.ModuleList([_Layer() for _ in range(3)])
    g.load_state_dict(ref.state_dict())
    for a, b in zip(ref, g):
        _set_version(b.steps, a.steps._version)
    cg.share_graph(g)
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(3, 4)
            y, z = x, x
            for a, b in zip(ref, g):
                y, z = a(y), b(z)
            assert torch.equal(y, z), step
            assert [a.steps._version for a in ref] == [b.steps._version for b in g], step
    assert sum(_replays(b) for b in g) >= 6


def test_control_a_written_buffer_rebound_to_an_inference_tensor_on_its_memory(sim):
    """No counter to move any more: that graph is captured again (inference_mode calls, as
    eager's, which cannot write an inference tensor outside it)."""
    def rebind(m):
        with torch.inference_mode():
            m.scale = torch.empty(0).set_(m.scale.untyped_storage(), 0, (4,), (1,))
    ref, g = _twins(_Scaled, warm=())
    with torch.inference_mode():
        for step in range(6):
            if step == 3:
                rebind(ref), rebind(g)
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), g(x)), step
            assert torch.equal(ref.scale, g.scale), step
    assert _replays(g) >= 3
