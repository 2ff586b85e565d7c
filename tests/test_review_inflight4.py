"""Fourth review of the in-flight training graphs: e96ab65 (a call that runs modules with buffers
first met in it, ``statics.adopt``, is DEFERRED quietly and the next call decides with value
marks for them; their parameters count as written only where the probe saw an in-place op on
their memory. ``Capturing._counting_versions`` also watches ``held_tensors()``, so a training
replay moves their version counters, and ``_warm_up_again`` adds the held tensors autograd saves
to ``saved_statics``, version-checked at backward).

CPU, on the simulated backend (``sim``, tests/conftest.py). Each check runs the same calls on an
eager twin and on the graphed one and compares raise / no-raise ("inplace": autograd's version
check) and values bitwise.

Findings (U1 and U2 fixed by the commit after e96ab65: a key is deferred for modules first met
in it once, and counts their unseen tensors as written when met with new modules again; with no
probe the new parameters count too. U3 (older) fixed later: it runs eagerly with a reason):

- U1 (performance + memory, regression of e96ab65): a forward that makes a module with buffers
  on every call (a graphed function ``lambda x: Helper()(x)``, a forward that builds a helper
  module per call, e.g. a torchaudio transform) adopts a new module on every call, so every call
  is DEFERRED: quiet deferrals are not bounded (``_engine._record``), so it is never graphed,
  with no warning, each call paying the whole first call (probe, clones, guards); and
  ``statics.roots`` keeps every module made (one more per call, with its buffers, for good).
  Before e96ab65: one capture, then replays.
- U2 (wrong values for good / a raise where eager has none, regression of e96ab65; probe=False):
  the parameters of adopted modules count as written only where the probe saw an in-place op on
  them; with ``probe=False`` no probe looked, so none do. An adopted module with no buffers is not
  deferred either (``new_buffers`` counts buffers only), so a forward that writes a parameter in
  place (weight clipping under no_grad, a decay) is written again by the extra warm-up (training,
  or ``num_warmup_iters>=2``) and by the capture's run, and neither its value nor its version is
  put back: the first call's backward raises "modified by an inplace operation" (even for an
  idempotent clamp), and a decay drifts from eager's for good. Before e96ab65 every adopted
  tensor counted as written where no probe looked.
- U3 (crash where eager runs; pre-existing, not e96ab65's): a nested tensor read from outside
  the arguments (a plain attribute, a closure) crashes the graphed call's first call: the probe's
  ``_read`` (``tuple(t.shape)``) and, with probe=False, the guard's ``_tensor_check``
  (``t.shape``) raise "NestedTensorImpl doesn't support sizes". A sparse tensor there runs
  eagerly with a reason (``_no_address``); a nested one should too.

Sound (controls below): one deferral per module with buffers first met (an outside module, a
graphed function's model, share_graph layers reaching one outside module, a bucketed graphed
function, capture_sizes reports every size graphed), modules without buffers made per call stay
graphed; the held tensors: views and ``.data`` aliases of parameters and buffers are not held
(``read_tensors`` leaves out the statics' storages), so nothing is counted twice and a ``.data``
alias written by forward raises nothing eager does not; a held tensor saved and never written
(two forwards before a backward, no raise), written in place by the user between forward and
backward (raise, as eager), a CPU scalar likewise; a held tensor one signature writes and another
saves; held tensors rebound between steps (new, ``.data``, ``detach()``: the guard recaptures,
and an eager op that saved the new object still raises); a closure tensor of a graphed function
written and saved; meta tensors held; a sparse one runs eagerly with the reason; an inference
tensor held.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify.api import _state_of

from test_review_inflight2 import _outcome, _same_as_eager, _step, _twins  # (one definition)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _WithBuf(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return x * self.scale


# -- U1: a module with buffers made on every call ----------------------------------------------

def _calls(g, n=6, grad=False):
    with torch.set_grad_enabled(grad):
        for _ in range(n):
            g(torch.randn(3, 4))
    return cg.stats(g)


def test_u1_function_making_a_module_with_buffers_per_call_gets_a_graph(sim):
    g = cg.graphify(lambda x: _WithBuf()(x) + 1)
    s = _calls(g)
    assert s.captures == 1 and s.replays >= 4, (s.captures, s.replays, s.eager_calls)


class _HelperPerCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _WithBuf()(self.lin(x))  # (a transform built per call: torchaudio's, say)


def test_u1_forward_making_a_helper_module_per_call_gets_a_graph(sim):
    g = cg.graphify(_HelperPerCall())
    s = _calls(g)
    assert s.captures == 1 and s.replays >= 4, (s.captures, s.replays, s.eager_calls)


def test_u1_modules_made_per_call_are_not_kept(sim):
    g = cg.graphify(lambda x: _WithBuf()(x) + 1)
    _calls(g, n=8)
    assert len(_state_of(g).statics.roots) <= 2, len(_state_of(g).statics.roots)


def test_u1_control_module_without_buffers_made_per_call_is_graphed(sim):
    g = cg.graphify(lambda x: nn.GELU()(x) + 1)
    s = _calls(g)
    assert s.captures == 1 and s.replays == 5, (s.captures, s.replays, s.eager_calls)


_SIDE: dict[str, nn.Module] = {}


class _ReachesOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _SIDE["norm"](self.lin(x))


def test_u1_control_outside_module_with_buffers_defers_once(sim):
    _SIDE["norm"] = _WithBuf()
    g = cg.graphify(_ReachesOutside())
    s = _calls(g)
    assert s.captures == 1 and s.replays == 4, (s.captures, s.replays, s.eager_calls)
    (why, n), = s.eager_calls.items()
    assert why.startswith("capture deferred") and n == 1, s.eager_calls


def test_u1_control_share_graph_layers_reaching_one_outside_module(sim):
    _SIDE["norm"] = _WithBuf()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_ReachesOutside() for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    net = Net()
    ref = copy.deepcopy(net)
    cg.share_graph(net.layers)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), net(x))
    for layer in net.layers:
        s = cg.stats(layer)
        assert s.replays + s.retargets >= 2 and sum(s.eager_calls.values()) == 1, s


def test_u1_control_capture_sizes_graphed_function_with_buffers(sim):
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    g = cg.graphify(lambda x: m(x))
    with torch.no_grad():
        done = cg.capture_sizes(g, lambda n: torch.randn(n, 4), [8, 4, 2], progress=False)
    assert done.graphed == [8, 4, 2] and not done.eager, str(done)


def test_u1_control_bucketed_graphed_function_with_buffers(sim):
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    g = cg.graphify(lambda x: m(x))
    b = cg.bucketed(g, sizes=[4, 8])
    with torch.no_grad():
        for n in (3, 3, 3, 5, 5):
            x = torch.randn(n, 4)
            torch.testing.assert_close(b(x), m(x))
    s = cg.stats(g)
    assert not b.refused and s.captures == 2 and s.replays >= 3, (b.refused, s)


# -- U2: probe=False, an adopted module without buffers that writes a parameter -----------------

class _Clamp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.b.weight.clamp_(-0.2, 0.2)
        return self.b(torch.relu(self.a(x)))


class _Decay(_Clamp):
    def forward(self, x):
        with torch.no_grad():
            self.b.weight.mul_(0.9)
        return self.b(torch.relu(self.a(x)))


def _function_training(cls, probe):
    torch.manual_seed(0)
    ref = cls()
    gm = copy.deepcopy(ref)
    g = cg.graphify(lambda x: gm(x), probe=probe)
    for step in range(4):
        x = torch.randn(3, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        a, b = ref(x), g(x2)
        ra = _outcome(lambda: a.sum().backward())
        rb = _outcome(lambda: b.sum().backward())
        assert ra == rb, (step, "eager:", ra, "graphed:", rb)
        assert torch.equal(a, b), step
        assert torch.equal(ref.b.weight, gm.b.weight), step
        assert torch.equal(x.grad, x2.grad) and torch.equal(ref.a.weight.grad, gm.a.weight.grad)
        ref.zero_grad(), gm.zero_grad()
    assert cg.stats(g).replays >= 2


def test_u2_probe_off_function_clamping_a_weight(sim):
    _function_training(_Clamp, False)


def test_u2_probe_off_function_decaying_a_weight(sim):
    _function_training(_Decay, False)


@pytest.mark.parametrize("cls", [_Clamp, _Decay])
def test_u2_control_probe_on(sim, cls):
    _function_training(cls, "auto")


class _Shrink(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(0.5)
        return x * self.w


def _frozen_inference(probe, warmups):
    ref, gm = _Shrink(), _Shrink()
    g = cg.graphify(lambda x: gm(x), probe=probe, num_warmup_iters=warmups)
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), g(x)), step
            assert torch.equal(ref.w, gm.w), (step, ref.w[0].item(), gm.w[0].item())
    assert cg.stats(g).replays >= 2


def test_u2_probe_off_frozen_parameter_two_warmups(sim):
    _frozen_inference(False, 2)


@pytest.mark.parametrize("probe,warmups", [(False, 1), ("auto", 2), ("auto", 3)])
def test_u2_control_frozen_parameter(sim, probe, warmups):
    _frozen_inference(probe, warmups)


# -- U3: a nested tensor read from outside --------------------------------------------------------

@pytest.mark.parametrize("probe", ["auto", False])
def test_u3_nested_tensor_read_from_a_closure_runs_eagerly_with_a_reason(sim, probe, quiet):
    # (it crashed: the probe's ``_read`` and the guard's ``_tensor_check`` read its shape,
    # "NestedTensorImpl doesn't support sizes"; now it runs eagerly as a sparse one does)
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    g = cg.graphify(lambda x: x * nt.unbind()[0].sum(), probe=probe)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            assert torch.equal(g(x), x * 2)
    s = cg.stats(g)
    assert s.captures == 0 and s.replays == 0, s
    assert [n for r, n in s.eager_calls.items() if "nested Tensor" in r] == [3], s.eager_calls


def test_u3_control_sparse_tensor_attribute_runs_eagerly_with_a_reason(sim):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.extra = torch.eye(4).to_sparse()

        def forward(self, x):
            return torch.sparse.mm(self.extra, self.lin(x).t()).t()

    ref, g = _twins(M, warm=(3, 5))
    _same_as_eager(ref, g, (3, 3))
    s = cg.stats(g)
    assert s.captures == 0 and any("sparse" in r for r in s.eager_calls), s.eager_calls


# -- (b): held tensors, controls ----------------------------------------------------------------

class _ReadOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = torch.linspace(0.5, 1.5, 4)
        self.alpha = torch.tensor(0.5)  # (a CPU scalar)

    def forward(self, x):
        return self.lin(x) * self.table * self.alpha


@pytest.mark.parametrize("shapes", [(3, 3), (3, 5)])
def test_b_control_held_saved_never_written_twins(sim, shapes):
    _same_as_eager(*_twins(_ReadOnly, warm=(3, 5)), shapes)


@pytest.mark.parametrize("what", ["table", "alpha"])
def test_b_control_held_written_by_the_user_between_forward_and_backward(sim, what):
    ref, g = _twins(_ReadOnly, warm=(3,))
    _same_as_eager(ref, g, (3,))
    seen = []
    for m in (ref, g):
        y = m(torch.randn(3, 4))
        getattr(m, what).mul_(1.0)
        seen.append(_outcome(lambda: y.sum().backward()))
        m.zero_grad()
    assert seen == ["inplace", "inplace"], seen


class _Cross(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = torch.linspace(0.5, 1.5, 4)

    def forward(self, x):
        if x.shape[0] > 4:
            self.table.mul_(1.01)
        return self.lin(x) * self.table


@pytest.mark.parametrize("shapes", [(3, 5), (5, 3), (3, 3), (5, 5)])
def test_b_control_held_written_by_one_signature_saved_by_another(sim, shapes):
    ref, g = _twins(_Cross, warm=(3, 5))
    _same_as_eager(ref, g, shapes)
    assert torch.equal(ref.table, g.table)


class _PlainAcc(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = torch.ones(4)

    def forward(self, x):
        self.acc.mul_(0.5)
        return self.lin(x) * self.acc


@pytest.mark.parametrize("rebind", ["new", "data", "detach"])
def test_b_control_held_rebound_between_steps(sim, rebind):
    def before(m):
        m.acc = torch.ones(4) if rebind == "new" else \
            m.acc.data if rebind == "data" else m.acc.detach()

    ref, g = _twins(_PlainAcc, warm=(3, 5))
    _same_as_eager(ref, g, (3, 3), steps=4, before=before)
    _same_as_eager(ref, g, (3,), steps=2, before=before)
    assert torch.equal(ref.acc, g.acc)


@pytest.mark.parametrize("rebind", ["data", "detach"])
def test_b_control_eager_op_saves_a_rebound_held_tensor_the_graph_writes(sim, rebind):
    ref, g = _twins(_PlainAcc, warm=(3,))
    seen = []
    for m in (ref, g):
        m(torch.randn(3, 4)).sum().backward()
        m.acc = m.acc.data if rebind == "data" else m.acc.detach()
        w = torch.randn(4, requires_grad=True)
        y = w * m.acc  # saves m.acc
        m(torch.randn(3, 4))  # writes it in place
        seen.append(_outcome(lambda: y.sum().backward()))
    assert seen == ["inplace", "inplace"], seen


class _AliasClip(nn.Module):
    """A ``.data`` alias of a trainable weight kept as a plain attribute, clamped by forward
    (its own version counter: not held, the weight's storage is a static's)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.bw = self.b.weight.data

    def forward(self, x):
        self.bw.clamp_(-0.3, 0.3)
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("shapes", [(3,), (3, 3), (3, 5)])
def test_b_control_data_alias_of_a_weight_written(sim, shapes):
    _same_as_eager(*_twins(_AliasClip, warm=(3, 5)), shapes)


class _ViewOfBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.half = self.scale[:2]  # (a plain attribute viewing the buffer: one counter)

    def forward(self, x):
        self.scale.mul_(0.5)
        return self.lin(x) * self.scale + self.half.sum()


def test_b_control_view_of_a_buffer_counter_moved_once(sim):
    ref, g = _twins(_ViewOfBuffer, warm=(3,))
    moves = []
    for m in (ref, g):
        v = m.scale._version
        m(torch.randn(3, 4)).sum().backward()
        moves.append(m.scale._version - v)
    assert moves[0] == moves[1], moves
    _same_as_eager(ref, g, (3, 3))


def test_b_control_closure_tensor_written_and_saved_twins(sim):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    for p in lin.parameters():
        p.requires_grad_(False)
    acc_r, acc_g = torch.ones(4), torch.ones(4)

    def fr(x):
        acc_r.mul_(0.5)
        return lin(x) * acc_r

    def fg(x):
        acc_g.mul_(0.5)
        return lin(x) * acc_g

    g = cg.graphify(fg)
    for step in range(5):
        xs = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
        seen = [_outcome(lambda f=f: sum(f(x).sum() for x in xs).backward()) for f in (fr, g)]
        assert seen[0] == seen[1], (step, seen)
        assert torch.equal(acc_r, acc_g), step
    assert cg.stats(g).replays >= 2


@pytest.mark.parametrize("kind", ["meta", "inference"])
def test_b_control_odd_held_tensors_in_training(sim, kind):
    with torch.inference_mode():
        inf = torch.linspace(0.5, 1.5, 4)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.extra = torch.empty(4, device="meta") if kind == "meta" else inf

        def forward(self, x):
            h = self.lin(x)
            return h * self.extra.shape[0] if kind == "meta" else h + self.extra

    ref, g = _twins(M, warm=(3, 5))
    _same_as_eager(ref, g, (3, 3))
    _same_as_eager(ref, g, (3,))
    assert cg.stats(g).replays >= 2
