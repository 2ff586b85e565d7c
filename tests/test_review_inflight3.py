"""Third review of the in-flight training graphs: 2653ffc (a training replay's version moves are
measured over the capture's run, ``Capturing._counting_versions``; the statics of modules first
met in a call, ``statics.adopt``, count as written where the probe saw an in-place op on their
memory, all of them where no probe looked, and ``watchable`` is re-read for them).

CPU, on the simulated backend (``sim``, tests/conftest.py). Each check runs the same calls on an
eager copy and on the graphed module and compares raise / no-raise ("inplace": autograd's version
check) and values bitwise.

Findings (T1-T3 fixed by the commit after 2653ffc: a call that meets modules with buffers for
the first time defers its capture to the next call, which has copies of them; a replay moves the
versions of the plain tensor attributes it writes, and a backward checks those it saved; T4
stays open, strict xfail):

- T1 (wrong values, for good; pre-existing, the R3 fix of 2653ffc is incomplete): the buffers of
  a module first met in the call count as written only where the *probe* saw an in-place op on
  them. BatchNorm's kernels update ``running_mean`` / ``running_var`` through no op the probe
  knows as a write (for the tree's own modules ``_writes.marks`` compares buffers by value, which
  needs a copy from before the call: there is none for an adopted module). So the extra warm-up
  updates the running statistics a second time and nothing puts them back (``num_batches_tracked``
  is put back: ``add_`` is seen). Hit by a module reaching a BatchNorm outside its tree in
  training, and by a graphed function over a BatchNorm module (training with an input that
  requires grad and no trainable parameter in it; or ``num_warmup_iters=2``).
- T2 (performance, regression of 2653ffc): with ``probe=False`` every parameter and buffer of an
  adopted module counts as written. A graphed *function* adopts all its modules on its first
  call, so each of its graphs has ``written_statics`` = every weight: the per-call fast path is
  never installed (``Fast.make`` refuses an entry with ``written_statics``), share_graph,
  rebasing and region chaining refuse it too, and each extra warm-up clones every weight (a full
  copy of the model). 2661480 installed the fast path here.
- T3 (silent where eager raises; pre-existing, outside 2653ffc's ``written``): a tensor kept as
  a plain attribute (not a buffer) that forward writes in place and autograd saves: two forwards
  of one signature before one backward (twin graphs) run silently, the first backward reading
  what the second replay wrote; eagerly "modified by an inplace operation". ``written`` and
  ``saved_statics`` cover parameters and buffers only.
- T4 (raise where eager does not, and a transient wrong buffer value; pre-existing): a forward
  whose first call writes one buffer and later calls another (the R1/R2 module of the last
  review). The extra warm-up and the capture's run take the later path and write ``tmp``, which
  the real call did not write: neither its value (extra warm-up) nor its version (both runs) is
  put back, since only the real call's ``wrote_statics`` are. The first call's own backward,
  which saved ``tmp``, raises; eagerly it does not. (2653ffc now *knows* the capture's run moved
  ``tmp``: ``version_moves`` names it.)

Controls (pass): an outside module's buffer with several extra warm-ups and twins; a module
writing a buffer twice per forward moves its counter as eager does; a trainable weight clamped
under no_grad (written through its stand-in alias, which shares the counter); ``probe=False``
over an outside module (R3's other half: fixed by 2653ffc); graphed functions whose modules have
trainable parameters (their first call is not captured); BatchNorm in eval mode outside the
tree; a hooked module graphed on its own; the fast path of a graphed function with the probe on
and of a module with ``probe=False``. GPU side: .ci/review/inflight3/run_all.sh.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _fast
from cudagraphify.api import _state_of

from test_review_inflight2 import _outcome, _same_as_eager, _step, _twins  # (one definition)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# -- T1: an adopted BatchNorm's running statistics ------------------------------------------------

_SIDE: dict[int, nn.Module] = {}


class _OuterBN(nn.Module):
    """Runs a BatchNorm held outside its tree (a plain dict): adopted on the first call."""

    def __init__(self, train=True):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        _SIDE[id(self)] = nn.BatchNorm1d(8).train(train)

    def side(self) -> nn.Module:
        return _SIDE[id(self)]

    def sync_from(self, other):
        self.side().load_state_dict(other.side().state_dict())

    def forward(self, x):
        return self.side()(self.lin(x))


def _outer_bn_run(train_bn: bool):
    torch.manual_seed(0)
    ref, g = _OuterBN(train_bn), _OuterBN(train_bn)
    g.load_state_dict(ref.state_dict())
    g.sync_from(ref)
    g = cg.graphify(g)
    for step in range(4):
        x = torch.randn(6, 4)
        a, b = ref(x), g(x)
        assert _outcome(lambda: a.sum().backward()) == _outcome(lambda: b.sum().backward())
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(ref.side(), name), getattr(g.side(), name)), (step, name)
        assert torch.equal(a, b), step


def test_t1_outside_batchnorm_running_stats_updated_twice(sim):
    _outer_bn_run(True)


def test_t1_control_outside_batchnorm_in_eval(sim):
    _outer_bn_run(False)


def test_t1_graphed_function_batchnorm_input_requires_grad(sim):
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(4, affine=False)
    gm = copy.deepcopy(ref)
    g = cg.graphify(lambda x: gm(x) * 2)
    for step in range(3):
        x = torch.randn(6, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        a, b = ref(x) * 2, g(x2)
        a.sum().backward()
        b.sum().backward()
        assert torch.equal(ref.running_mean, gm.running_mean), step
        assert torch.equal(a, b), step
        assert torch.equal(x.grad, x2.grad), step


def test_t1_graphed_function_batchnorm_two_warmups(sim):
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(4)
    gm = copy.deepcopy(ref)
    g = cg.graphify(lambda x: gm(x), num_warmup_iters=2)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(6, 4)
            a, b = ref(x), g(x)
            assert torch.equal(ref.running_mean, gm.running_mean), step
            assert torch.equal(a, b), step


def test_t1_control_function_batchnorm_two_warmups_probe_off(sim):
    # (probe=False: every adopted buffer counts as written, so it is put back; see T2's cost)
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(4)
    gm = copy.deepcopy(ref)
    g = cg.graphify(lambda x: gm(x), num_warmup_iters=2, probe=False)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(6, 4)
            a, b = ref(x), g(x)
            assert torch.equal(ref.running_mean, gm.running_mean), step
            assert torch.equal(a, b), step


def test_t1_control_function_batchnorm_with_trainable_params(sim):
    # (the first call runs modules whose parameters require grad: not captured, decided on the
    # next call, which has the buffers' marks)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    gm = copy.deepcopy(ref)
    g = cg.graphify(lambda x: gm(x))
    for step in range(4):
        x = torch.randn(6, 4)
        a, b = ref(x), g(x)
        a.sum().backward()
        b.sum().backward()
        assert torch.equal(ref[1].running_mean, gm[1].running_mean), step
        assert torch.equal(a, b), step
    assert cg.stats(g).replays >= 2


# -- T2: probe=False, a graphed function: every weight "written" ----------------------------------

def _fast_installed(make_target, probe) -> bool:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    g = cg.graphify(make_target(m), probe=probe)
    with torch.no_grad():
        for _ in range(4):
            g(torch.randn(3, 4))
    assert cg.stats(g).replays >= 2
    return type(_state_of(g)._fast) is _fast.Fast


def test_t2_probe_off_function_gets_the_fast_path(sim):
    assert _fast_installed(lambda m: (lambda x: m(x)), False)


@pytest.mark.parametrize("target,probe", [("function", "auto"), ("module", False),
                                          ("module", "auto")])
def test_t2_control_fast_path(sim, target, probe):
    make = (lambda m: (lambda x: m(x))) if target == "function" else (lambda m: m)
    assert _fast_installed(make, probe)


# -- T3: a plain tensor attribute written and saved -----------------------------------------------

class _PlainAcc(nn.Module):
    """``acc`` is a plain tensor attribute (no buffer), written in place, then saved by mul."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = torch.ones(4)

    def sync_from(self, other):
        self.acc = other.acc.clone()

    def forward(self, x):
        self.acc.mul_(0.5)
        return self.lin(x) * self.acc


def _same_acc(ref, g, step):
    assert torch.equal(ref.acc, g.acc), step


@pytest.mark.parametrize("shapes", [(3, 3), (5, 3)])
def test_t3_plain_attribute_written_and_saved_twins(sim, shapes):
    ref, g = _twins(_PlainAcc, warm=(3, 5))
    _same_as_eager(ref, g, shapes, extra=_same_acc)


@pytest.mark.parametrize("shapes", [(3,), (3, 5)])
def test_t3_control_plain_attribute(sim, shapes):
    ref, g = _twins(_PlainAcc, warm=(3, 5))
    _same_as_eager(ref, g, shapes, extra=_same_acc)


# -- T4: a write only later calls make, and the first call's backward -----------------------------

class _FirstCallWrites(nn.Module):
    """The first call writes ``scale``, later calls ``tmp`` (one op, ``out=`` another buffer)."""

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


def _first_calls(saved: str):
    torch.manual_seed(0)
    ref, g = _FirstCallWrites(saved), _FirstCallWrites(saved)
    g.load_state_dict(ref.state_dict())
    g = cg.graphify(g)
    for step in range(3):
        x = torch.randn(3, 4)
        a = _outcome(lambda: ref(x).sum().backward())
        b = _outcome(lambda: g(x).sum().backward())
        assert a == b, (step, "eager:", a, "graphed:", b)
        assert torch.equal(ref.tmp, g.tmp), (step, ref.tmp, g.tmp)
        assert torch.equal(ref.scale, g.scale), step


def test_t4_first_calls_backward_raises(sim):
    _first_calls("tmp")


def test_t4_buffer_value_after_the_first_call(sim):
    _first_calls("scale")


# -- controls -------------------------------------------------------------------------------------

class _Side(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, h):
        self.scale.mul_(0.5)
        return h * self.scale


class _OuterMixed(nn.Module):
    """An own buffer written and an outside module's buffer written (adopted: watchable is
    re-read, so ``wrote_statics`` indexes the longer list)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("own", torch.ones(4))
        _SIDE[id(self)] = _Side()

    def side(self) -> nn.Module:
        return _SIDE[id(self)]

    def sync_from(self, other):
        self.side().scale.copy_(other.side().scale)

    def forward(self, x):
        self.own.add_(1.0)
        return self.side()(self.lin(x) * self.own)


def _same_side(ref, g, step):
    assert torch.equal(ref.side().scale, g.side().scale), step
    assert ref.side().scale._version - g.side().scale._version == \
        _same_side.offset, (step, ref.side().scale._version, g.side().scale._version)


@pytest.mark.parametrize("warmups", [1, 3])
@pytest.mark.parametrize("shapes", [(3,), (3, 3), (3, 5), (5, 3)])
def test_outside_and_own_buffers_written(sim, warmups, shapes):
    ref, g = _twins(_OuterMixed, warm=(3, 5), num_warmup_iters=warmups)
    _same_side.offset = ref.side().scale._version - g.side().scale._version
    _same_as_eager(ref, g, shapes, extra=_same_side)


class _TwiceWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        self.scale.mul_(0.5)
        self.scale.add_(0.25)
        return self.lin(x) * self.scale


def test_two_writes_per_forward_move_the_counter_as_eager(sim):
    ref, g = _twins(_TwiceWrite, warm=(3, 5))
    _same_as_eager(ref, g, (3, 3))
    moves = []
    for m in (ref, g):
        v = m.scale._version
        m(torch.randn(3, 4)).sum().backward()
        m(torch.randn(5, 4)).sum().backward()
        moves.append(m.scale._version - v)
    assert moves[0] == moves[1], moves


class _Clamp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.b.weight.clamp_(-0.3, 0.3)
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("shapes", [(3, 3), (3, 5)])
def test_trainable_weight_written_through_its_stand_in(sim, shapes):
    ref, g = _twins(_Clamp, warm=(3, 5))
    _same_as_eager(ref, g, shapes)
    v = [m.b.weight._version for m in (ref, g)]
    for m in (ref, g):
        m(torch.randn(3, 4)).sum().backward()
    assert [m.b.weight._version for m in (ref, g)] == [v[0] + 1, v[1] + 1]


def test_probe_off_outside_module(sim):
    torch.manual_seed(0)

    class Outer(_OuterMixed):
        def forward(self, x):
            return self.side()(self.lin(x))

    ref, g = _twins(Outer, warm=(), probe=False)
    g.side().scale.copy_(ref.side().scale)
    for step in range(3):
        x = torch.randn(3, 4)
        a, b = ref(x), g(x)
        assert _outcome(lambda: a.sum().backward()) == _outcome(lambda: b.sum().backward())
        assert torch.equal(ref.side().scale, g.side().scale), step
        assert torch.equal(a, b), step


class _HookedScale(nn.Module):
    """A full backward hook writes a buffer forward reads (graphed on its own, a piece)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gstat", torch.ones(4))
        self.register_full_backward_hook(self._hook)

    def _hook(self, mod, gin, gout):
        with torch.no_grad():
            self.gstat.mul_(0.5).add_(gout[0].abs().mean(0))

    def forward(self, x):
        return x * self.gstat


def test_backward_hook_writing_a_read_buffer(sim):
    torch.manual_seed(0)

    def make():
        return nn.Sequential(nn.Linear(4, 4), _HookedScale(), nn.Linear(4, 4))

    ref, g = make(), make()
    g.load_state_dict(ref.state_dict())
    g = cg.graphify(g)
    for step in range(4):
        x = torch.randn(3, 4)
        a = _outcome(lambda: ref(x).sum().backward())
        b = _outcome(lambda: g(x).sum().backward())
        assert a == b, (step, a, b)
        assert torch.equal(ref[1].gstat, g[1].gstat), step
