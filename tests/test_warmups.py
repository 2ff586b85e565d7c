"""The runs beyond a signature's real call (cudagraphify/_warmups.py, the extra warm-ups; the
capture's run): after the first call, what the user sees is what eager's one call left (values,
layouts, version counters), whatever those runs write, memory the real call did not write
included: a buffer, a parameter, a plain tensor attribute, a global or a view written only by
the calls after the first (the path the extra warm-ups and the capture's run take).

CPU, on the simulated backend (``sim``, tests/conftest.py: a replay re-runs the ops captured).
Each module runs on an eager twin and graphed; everything is compared bitwise after every call.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture
from cudagraphify._errors import CaptureFailed

from conftest import SimBackend, _Recorder


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# tensors kept outside the modules (a global), one per instance (each twin has its own)
_GLOBAL: dict[int, torch.Tensor] = {}


class _LaterPath(nn.Module):
    """Its first call adds to buffer ``scale``; the later calls (the extra warm-ups and the
    capture's run take their path) add to ``target`` instead: one op either way, so the capture
    matches the real call op for op. The write accumulates: a run beyond the real call that is
    not put back leaves ``target`` a step ahead of eager's."""

    def __init__(self, target: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.kind = target
        self.ready = False
        if target == "buffer":
            self.register_buffer("tmp", torch.zeros(4))
        elif target == "parameter":
            self.w = nn.Parameter(torch.zeros(4))
        elif target == "plain":  # (a plain tensor attribute the first call does not read)
            self.acc = torch.zeros(4)
        elif target == "global":
            _GLOBAL[id(self)] = torch.zeros(4)
        elif target == "view":  # (a view of a buffer's memory, kept as a plain attribute)
            self.register_buffer("big", torch.zeros(8))
            self.half = self.big[4:]
        elif target == "buffer view":  # (a buffer that is a view of another buffer)
            self.register_buffer("big", torch.zeros(8))
            self.register_buffer("part", self.big[2:6])

    def target(self) -> torch.Tensor:
        kind = self.kind
        return (self.tmp if kind == "buffer" else self.w if kind == "parameter"
                else self.acc if kind == "plain" else _GLOBAL[id(self)] if kind == "global"
                else self.half if kind == "view" else self.part)

    def forward(self, x):
        t = self.target() if self.ready else self.scale
        with torch.no_grad():
            t.add_(0.5)
        self.ready = True
        return self.lin(x) * self.scale


_TARGETS = ["buffer", "parameter", "plain", "global", "view", "buffer view"]


def _twins(make, **options):
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    g = make()
    return ref, cg.graphify(g, **options)


def _state(m) -> dict:
    """What the user sees of ``m``: its parameters and buffers, and its target tensor."""
    out = {f"state {n}": t for n, t in (*m.named_parameters(), *m.named_buffers())}
    if hasattr(m, "target"):
        out["target"] = m.target()
    return out


def _versions(m) -> dict:
    return {n: t._version for n, t in _state(m).items()}


def _same_as_eager(ref, g, *, calls=4, grad=False, shape=(3, 4)):
    """``calls`` calls of both twins (a backward after each with ``grad``): outputs, gradients,
    parameters, buffers and the target tensor bitwise equal after every call, and after the
    first the version counters moved as eagerly."""
    v_ref, v_g = _versions(ref), _versions(g)
    torch.manual_seed(1)
    for call in range(calls):
        x = torch.randn(*shape)
        with torch.enable_grad() if grad else torch.no_grad():
            a, b = ref(x), g(x)
            if grad:
                a.sum().backward()
                b.sum().backward()
        assert torch.equal(a, b), f"output, call {call}"
        want, got = _state(ref), _state(g)
        for name in want:
            assert got[name].shape == want[name].shape, (call, name, got[name], want[name])
            assert torch.equal(got[name], want[name]), (call, name, got[name], want[name])
        if grad:
            for (n, p), q in zip(ref.named_parameters(), g.parameters()):
                assert (p.grad is None) == (q.grad is None), (call, n)
                assert p.grad is None or torch.equal(p.grad, q.grad), (call, n)
        if call == 0:
            now_ref, now_g = _versions(ref), _versions(g)
            moved = {n: (now_g[n] - v_g[n], now_ref[n] - v_ref[n]) for n in now_ref}
            assert all(a == b for a, b in moved.values()), \
                f"version moves after the first call (graphed, eager): {moved}"


# -- a tensor only the later calls write ----------------------------------------------------

@pytest.mark.parametrize("target", _TARGETS)
@pytest.mark.parametrize("iters", [2, 3])
def test_inference_extra_warmups_put_back_what_only_they_write(sim, target, iters):
    ref, g = _twins(lambda: _LaterPath(target), num_warmup_iters=iters)
    _same_as_eager(ref, g)
    assert cg.stats(g).replays >= 2, cg.stats(g)  # (the later calls replay what it captured)


@pytest.mark.parametrize("target", _TARGETS)
def test_training_extra_warmup_puts_back_what_only_it_writes(sim, target):
    # (grad mode: one extra warm-up, with its backward, whatever num_warmup_iters says)
    ref, g = _twins(lambda: _LaterPath(target))
    _same_as_eager(ref, g, grad=True)


def test_the_captures_run_alone_moves_no_version(sim):
    # (inference, num_warmup_iters=1: no extra warm-up; the capture's run writes ``tmp``, which
    # the real call did not: its bytes are the capture's business, its version counter ours)
    ref, g = _twins(lambda: _LaterPath("buffer"))
    _same_as_eager(ref, g)
    assert cg.stats(g).replays == 3, cg.stats(g)


class _EveryCall(nn.Module):
    """Writes a buffer and a plain tensor attribute on every call (the real call's writes)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(4))
        self.acc = torch.zeros(4)

    def target(self):
        return self.acc

    def forward(self, x):
        self.count.add_(1)
        self.acc.add_(self.count)
        return self.lin(x) * self.count


@pytest.mark.parametrize("grad", [False, True])
def test_control_writes_the_real_call_makes_too(sim, grad):
    ref, g = _twins(_EveryCall, num_warmup_iters=3)
    _same_as_eager(ref, g, grad=grad)


# -- a graphed function ----------------------------------------------------------------------

_FN_STATE = {"ready": False, "g": torch.zeros(4)}
_REF_STATE = {"ready": False, "g": torch.zeros(4)}


def _later_global(state, x):
    if state["ready"]:
        state["g"].add_(0.5)  # (a global only the later calls write)
    state["ready"] = True
    return x * 2


def test_a_graphed_function_puts_back_a_global_only_later_calls_write(sim):
    _FN_STATE.update(ready=False, g=torch.zeros(4))
    _REF_STATE.update(ready=False, g=torch.zeros(4))
    g = cg.graphify(lambda x: _later_global(_FN_STATE, x), num_warmup_iters=3)
    for call in range(4):
        x = torch.randn(4)
        with torch.no_grad():
            assert torch.equal(g(x), _later_global(_REF_STATE, x)), call
        assert torch.equal(_FN_STATE["g"], _REF_STATE["g"]), (call, _FN_STATE["g"])


# -- writes no op names: running statistics, a layout changed by set_ --------------------------

class _LaterStats(nn.Module):
    """Batch norm over buffers in eval on the first call, in training on later calls: only the
    later calls update the running statistics, which no version counter or op name tells."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))
        self.ready = False

    def forward(self, x):
        h = F.batch_norm(self.lin(x), self.mean, self.var, training=self.ready)
        self.ready = True
        return h


@pytest.mark.parametrize("iters", [2, 3])
def test_running_statistics_only_later_calls_update(sim, iters):
    ref, g = _twins(_LaterStats, num_warmup_iters=iters)
    _same_as_eager(ref, g)


class _LaterRelayout(nn.Module):
    """The later calls grow a buffer by ``set_`` (no probe sees it) or rebind a parameter's
    memory by ``.data =``; the first call does neither."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("log", torch.zeros(0))
        self.how = how
        self.ready = False

    def forward(self, x):
        h = self.lin(x)
        if self.ready:
            if self.how == "set_":
                self.log.set_(torch.cat([self.log, h[0].detach()]))
            else:
                self.lin.bias.data = self.lin.bias.data * 2
        self.ready = True
        return h


@pytest.mark.parametrize("how", ["set_", ".data ="])
def test_a_layout_only_later_calls_change(sim, how):
    ref, g = _twins(lambda: _LaterRelayout(how), num_warmup_iters=2)
    _same_as_eager(ref, g, calls=1)  # (the first call; what later calls decide is no matter)
    assert g.log.shape == ref.log.shape


# -- a failed extra run ----------------------------------------------------------------------

class _LaterFails(_LaterPath):
    """The later calls write ``tmp``, then raise."""

    def forward(self, x):
        later = self.ready
        out = super().forward(x)
        if later:
            raise ValueError("later calls fail")
        return out


def test_a_failed_extra_warmup_leaves_no_write(sim):
    ref, g = _twins(lambda: _LaterFails("buffer"), num_warmup_iters=2)
    with torch.no_grad():
        x = torch.randn(3, 4)
        assert torch.equal(ref(x), g(x))
    assert torch.equal(ref.tmp, g.tmp), g.tmp
    assert torch.equal(ref.scale, g.scale)


# -- probe=False -----------------------------------------------------------------------------

@pytest.mark.parametrize("grad", [False, True])
def test_probe_off_a_buffer_only_later_calls_write(sim, grad):
    # (no probe copies before a write: the copies the real call took to compare the buffers by
    # value put them back)
    ref, g = _twins(lambda: _LaterPath("buffer"), num_warmup_iters=2, probe=False)
    _same_as_eager(ref, g, grad=grad)


def test_probe_off_a_parameter_only_later_calls_write_is_refused_with_the_reason(sim):
    # (nothing could copy it before the write: the signature runs eagerly, with the reason)
    ref, g = _twins(lambda: _LaterPath("parameter"), num_warmup_iters=2, probe=False)
    with torch.no_grad():
        g(torch.randn(3, 4))
    reasons = cg.stats(g).eager_calls
    assert any("parameter 'w'" in r and "could not be put back" in r for r in reasons), reasons
    assert cg.stats(g).captures == 0


# -- a write no probe sees -------------------------------------------------------------------

class _LaterUnseen(_LaterPath):
    """The later calls write parameter ``w`` where no torch function mode looks (as a C++
    extension's in-place op would): its version moves, no probe saw it."""

    def forward(self, x):
        if self.ready:
            with torch.no_grad(), torch._C.DisableTorchFunction():
                self.w.add_(0.5)
        self.ready = True
        return self.lin(x) * self.scale


def test_a_write_no_probe_sees_is_refused_with_the_reason(sim):
    ref, g = _twins(lambda: _LaterUnseen("parameter"), num_warmup_iters=2)
    with torch.no_grad():
        g(torch.randn(3, 4))
    reasons = cg.stats(g).eager_calls
    assert any("parameter 'w'" in r and "no probe saw the write" in r for r in reasons), reasons
    assert cg.stats(g).captures == 0


# -- what the graph writes, the real call's writes aside ---------------------------------------

def test_an_argument_sharing_a_buffer_only_the_graph_writes_is_not_read_from_a_copy(sim):
    # The graph (the later path) writes ``tmp``, the real call ``scale``: an argument that is
    # ``tmp``'s memory must be read after the write, as eagerly, not from a copy made before it.
    # (of one signature: a (4,) tensor, as the first call's argument)
    ref, g = _twins(lambda: _LaterPath("buffer"))
    with torch.no_grad():
        for call in range(4):
            a = ref(ref.tmp.view(4) if call >= 2 else torch.ones(4))
            b = g(g.tmp.view(4) if call >= 2 else torch.ones(4))
            assert torch.equal(a, b), call
            assert torch.equal(ref.tmp, g.tmp), call


# -- a rehearsal (a run on which the forward is told it is captured) -------------------------

from test_engine import _trusting, faithful  # noqa: E402,F401 (a fixture)

_WHILE_CAPTURED: dict[int, torch.Tensor] = {}


class _AsksWhenCaptured(nn.Module):
    """Takes a host-syncing shortcut eagerly; its path while captured (a rehearsal's, the
    capture's) adds to ``scale``, a buffer autograd saves, and to a global only that path
    writes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        _WHILE_CAPTURED[id(self)] = torch.zeros(4)

    def target(self):
        return _WHILE_CAPTURED[id(self)]

    def forward(self, x):
        with torch.no_grad():
            self.scale.add_(0.5)
        y = self.lin(x) * self.scale
        if not torch.cuda.is_current_stream_capturing() and bool((y > -1e9).all()):
            return y
        with torch.no_grad():
            self.target().add_(1)
        return torch.where(y > -1e9, y, torch.zeros_like(y))


@pytest.mark.parametrize("grad", [False, True])
def test_a_rehearsal_moves_no_version(faithful, grad):
    ref, g = _twins(_AsksWhenCaptured, op_policy=_trusting(__name__))
    _same_as_eager(ref, g, calls=1, grad=grad)


class _ViewReadLaterBase(nn.Module):
    """Reads a plain attribute that views the second half of buffer ``big`` on every call; the
    later calls also write the first half, through the buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("big", torch.zeros(8))
        self.half = self.big[4:]
        self.ready = False

    def target(self):
        return self.big

    def forward(self, x):
        if self.ready:
            with torch.no_grad():
                self.big[:4].add_(0.5)
        self.ready = True
        return self.lin(x) * self.half


@pytest.mark.parametrize("grad", [False, True])
def test_a_buffer_part_only_later_calls_write_beside_a_view_the_call_reads(sim, grad):
    ref, g = _twins(_ViewReadLaterBase, num_warmup_iters=2)
    _same_as_eager(ref, g, grad=grad)


# -- memory handed out past torch -------------------------------------------------------------

class _LaterNumpy(_LaterPath):
    """The later calls write buffer ``tmp`` through numpy (as a kernel launched with its
    address would: no op, no version) and hand out the weight's address (as such a kernel
    reading it would)."""

    def forward(self, x):
        if self.ready:
            self.lin.weight.data_ptr()
            self.tmp.numpy()[:] += 0.5
        self.ready = True
        return self.lin(x) * self.scale


def test_memory_handed_out_past_torch_is_put_back(sim):
    ref, g = _twins(lambda: _LaterNumpy("buffer"), num_warmup_iters=3)
    _same_as_eager(ref, g, calls=1)  # (what later calls decide is no matter)


def test_a_weight_handed_out_past_torch_is_not_copied(sim, monkeypatch):
    # (a kernel launched with a weight's address reads it: a copy of every weight such
    # kernels read would cost a copy of the model; a buffer's is taken)
    from cudagraphify import _writes

    copied = []
    put_back = _writes.put_storages_back

    def spy(saved):
        copied.extend(p for p, kept in saved.items() if kept is not None)
        put_back(saved)

    monkeypatch.setattr(_writes, "put_storages_back", spy)
    _, g = _twins(lambda: _LaterNumpy("buffer"), num_warmup_iters=2)
    with torch.no_grad():
        g(torch.randn(3, 4))
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert ptr(g.tmp) in copied and ptr(g.lin.weight) not in copied, copied


# -- a capture whose run is real for the host's memory (CUDA's, for CPU tensors) ---------------

class _HostSim(SimBackend):
    """The simulated capture as CUDA's treats the host's tensors: their ops run for real (the
    conftest double puts back what its run wrote, as CUDA's does for the device's). Here every
    tensor is the host's."""

    capture_runs_kernels = False

    def capture(self, fn, device, pool=None, keep_graph=False):
        rec = _Recorder()
        self._tls.depth = getattr(self._tls, "depth", 0) + 1
        t0 = time.perf_counter()
        try:
            with rec:
                out = fn()
        except Exception as e:
            raise CaptureFailed(f"{type(e).__name__}: {e}") from e
        finally:
            self._tls.depth -= 1
            rec.saved.clear()  # (written for real: nothing to put back)
        self.captures += 1
        g = self.graph_class(rec, self, pool, time.perf_counter() - t0)
        self.graphs.append(g)
        return g, out


@pytest.fixture
def host_sim():
    backend = _HostSim()
    old = _capture.set_backend(backend)
    try:
        yield backend
    finally:
        _capture.set_backend(old)


@pytest.mark.parametrize("make", [_EveryCall, lambda: _LaterPath("buffer"),
                                  lambda: _LaterPath("global"), lambda: _LaterPath("plain")],
                         ids=["every call", "later buffer", "later global", "later plain"])
@pytest.mark.parametrize("grad", [False, True])
def test_the_host_memory_a_captures_run_writes_for_real_is_put_back(host_sim, make, grad):
    ref, g = _twins(make)
    _same_as_eager(ref, g, calls=1, grad=grad)  # (the first call: a replay runs no host work)
