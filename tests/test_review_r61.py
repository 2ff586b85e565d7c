"""Review of edf618b, 7203dea, d5ecd23 (arguments sharing memory with held tensors run eagerly;
explain puts the module back; the held-tensor follow-ups of helper-60's review), on the
simulated backend.

Tests named ``test_finding_*`` failed on the code reviewed (one group per finding, A-E); all
five were fixed after the review. The others are controls. Every comparison is with eager PyTorch on a copy of the module (or the
same function run eagerly), outputs and state.
"""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch
from torch import nn

import cudagraphify as cg
from conftest import SimBackend  # noqa: F401 (the fixtures' backend)
from test_engine import _trusting, faithful  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("quiet")


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# -- F-A (wrong values, introduced by 7203dea): explain puts back part of the module state ----


class DynamicRope(nn.Module):
    """HF's dynamic rotary embedding, reduced: a sequence longer than the cached length
    registers a rescaled ``inv_freq`` buffer again and notes the length in an int attribute;
    a short sequence after a long one registers the original again."""

    def __init__(self, dim: int = 4, original: int = 8):
        super().__init__()
        self.original = original
        self.max_seq_len_cached = original
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.original_inv_freq = inv

    def forward(self, x):
        n = x.shape[0]
        if n > self.max_seq_len_cached:
            self.register_buffer("inv_freq", self.original_inv_freq * (self.original / n),
                                 persistent=False)
            self.max_seq_len_cached = n
        if n < self.original and self.max_seq_len_cached > self.original:
            self.register_buffer("inv_freq", self.original_inv_freq, persistent=False)
            self.max_seq_len_cached = self.original
        t = torch.arange(n, dtype=torch.float32)
        return x * torch.outer(t, self.inv_freq).cos().repeat(1, 2)


def test_finding_a_explain_dynamic_rope_keeps_the_rescaled_buffer(sim):
    """``left_as_they_were`` puts back ``max_seq_len_cached`` (an attribute in ``__dict__``)
    but not the ``_buffers`` registry, which the forward changed in place (the same dict
    object, so ``now.get('_buffers') is value``; ``restored`` puts back the values of the old
    buffer objects only): after explain on a long example the module holds the rescaled
    ``inv_freq`` with the original length, and a short call no longer resets it. Before
    7203dea both stayed, consistently, and the short call was right."""
    ref = DynamicRope()
    m = copy.deepcopy(ref)
    cg.explain(m, torch.randn(16, 4))
    x = torch.randn(4, 4)
    assert torch.equal(m(x), ref(x))
    assert torch.equal(m.inv_freq, ref.inv_freq)


class LazyCounter(nn.Module):
    """Registers a step-count buffer on its first call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if not hasattr(self, "steps"):
            self.register_buffer("steps", torch.zeros(()))
        self.steps += 1
        return self.lin(x) + self.steps


def test_finding_a_explain_leaves_a_buffer_its_runs_registered(sim):
    """explain's two runs register the buffer and count to 2: the buffer stays (the module
    is not "as it was"), and every later call is two steps ahead of eager."""
    torch.manual_seed(0)
    ref = LazyCounter()
    m = copy.deepcopy(ref)
    cg.explain(m, torch.randn(2, 4))
    assert "steps" not in dict(m.named_buffers())
    with torch.no_grad():
        for i in range(2):
            x = torch.randn(2, 4)
            assert close(m(x), ref(x)), i


# -- F-B (wrong values): runs that are not calls write what the real call left in an attribute --


class Ring(nn.Module):
    """A rolling buffer kept as a plain tensor attribute: written in place, then rebound to
    a rolled copy (``torch.roll``: new memory)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ring = torch.zeros(100)

    def forward(self, x):
        self.ring[0] += 1
        self.ring = torch.roll(self.ring, 1)
        return self.lin(x) + self.ring[:4]


@pytest.mark.parametrize("warmups", [2, 3])
def test_finding_b_extra_warmups_write_the_tensor_the_real_call_left(sim, warmups):
    """The guard (and so ``held_tensors()``, which ``undone`` protects) holds the tensor the
    real call *read first* (``Recorder.read`` keeps the first read), not the one it left in
    the attribute. The extra warm-ups write that one in place; ``Recorder.undo`` rebinds the
    attribute to it, written: one more step per extra warm-up."""
    torch.manual_seed(0)
    ref = Ring()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.ring, ref.ring), (i, g.ring[:4], ref.ring[:4])


class Log(nn.Module):
    """Appends to a list attribute, then keeps its last three items (a new list)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log = []

    def forward(self, x):
        self.log.append(len(self.log))
        self.log = self.log[-3:]
        return self.lin(x) * len(self.log)


@pytest.mark.parametrize("warmups", [1, 3])
def test_finding_b_capture_appends_to_the_list_the_real_call_left(sim, warmups):
    """Likewise for a container: ``warm_guard.restore()`` puts back the items of the list the
    real call read first (unchanged), not of the list it left in ``self.log``; the extra
    warm-ups and the capture's run append to that one, and ``rec.undo()`` rebinds the
    attribute to it (verify's path calls no restore at all). One call leaves ``[0, 1]`` (with
    three warm-ups ``[0, 1, 2]``) where eager leaves ``[0]``; the outputs follow."""
    torch.manual_seed(0)
    ref = Log()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert g.log == ref.log, (i, g.log, ref.log)


# -- F-C (wrong values): a rehearsal keeps the module attributes it sets -----------------------


class AsksAndCounts(nn.Module):
    """Trusted capture-aware code (a host sync on its eager path, none when captured) that
    counts its calls in an int attribute and scales by the count."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.n = 0

    def forward(self, x):
        self.n += 1
        if not torch.cuda.is_current_stream_capturing():
            bool((x > -1e9).all())  # a host sync
        return self.lin(x) * self.n


def test_finding_c_rehearsal_keeps_its_attribute_writes(faithful):
    """d5ecd23 undoes the module attribute writes of the extra warm-ups and of a failed
    capture, but ``rehearse`` (one more eager run, on the captured path) records none and puts
    back only parameters, buffers, held tensors and the RNG: after the first call ``n`` is 2
    where eager's is 1, and every later output is scaled by one more."""
    torch.manual_seed(0)
    ref = AsksAndCounts()
    g = cg.graphify(copy.deepcopy(ref), op_policy=_trusting(__name__))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert g.n == ref.n, (i, g.n, ref.n)


# -- F-D (wrong values, older than these commits): a held tensor's metadata written in place ----


class Transposer(nn.Module):
    """Transposes a plain tensor attribute in place on every call (``t_()``: metadata only)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.m = torch.randn(10, 10)

    def forward(self, x):
        self.m.t_()
        return self.lin(x).repeat(1, 3)[:, :10] @ self.m


@pytest.mark.parametrize("warmups", [1, 3])
def test_finding_d_held_tensor_metadata_written_by_runs_that_are_not_calls(sim, warmups):
    """``undone`` puts back a held tensor's bytes and version, not its sizes and strides: the
    capture's run (and each extra warm-up) transposes ``m`` once more (the guard then fails,
    so the calls run eagerly, on the wrongly transposed matrix)."""
    torch.manual_seed(0)
    ref = Transposer()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.m, ref.m), i


# -- F-E (wrong values): verify's refusal of an attribute write undoes module attributes only ----


class StepAndCount(nn.Module):
    """Counts its calls in an int attribute and in a config object (or a dict) it holds; the
    output is scaled by the object's count."""

    def __init__(self, in_dict: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.in_dict = in_dict
        self.cfg = types.SimpleNamespace(step=0)
        self.st = {"step": 0}
        self.n = 0

    def forward(self, x):
        self.n += 1
        if self.in_dict:
            self.st["step"] += 1
            return self.lin(x) * self.st["step"]
        self.cfg.step += 1
        return self.lin(x) * self.cfg.step


@pytest.mark.parametrize("in_dict", [False, True])
@pytest.mark.parametrize("warmups", [1, 3])
def test_finding_e_attribute_write_refusal_keeps_the_captures_object_writes(sim, warmups,
                                                                            in_dict):
    """The capture's run sets ``self.n``: ``verify`` (_first_call.py:338-341) calls
    ``rec.undo()`` and returns, without ``self.warm_guard.restore()``, which the next branch
    (a changed object or container) and the failed-capture path call. The capture's
    ``cfg.step += 1`` (``st["step"] += 1``) stays: 2 after the first call where eager has 1,
    and the outputs are scaled one more from then on. (Alone, without ``self.n``, the object's
    write is put back: see the control below.)"""
    torch.manual_seed(0)
    ref = StepAndCount(in_dict)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert (g.n, g.cfg.step, g.st) == (ref.n, ref.cfg.step, ref.st), i


def test_finding_e_function_closure_cell_with_a_module_attribute_write(sim):
    """The same for a graphed function: a closure cell it rebinds (``nonlocal step``) next to
    a module attribute it sets."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    lin.calls = 0
    step = 0

    def f(x):
        nonlocal step
        step += 1
        lin.calls += 1
        return lin(x) * step

    g = cg.graphify(f)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            want = lin(x) * (i + 1)
            assert close(g(x), want), i
            assert (step, lin.calls) == (i + 1, i + 1), (i, step, lin.calls)


# -- controls ------------------------------------------------------------------------------


class Hits(nn.Module):
    def __init__(self, n: int = 100):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hits = torch.zeros(n)

    def forward(self, x):
        self.hits.add_(1)
        return self.lin(x) + self.hits[:4]


class Root(nn.Module):
    """A root that sets an attribute (piecewise) over two pieces with held counters."""

    def __init__(self):
        super().__init__()
        self.a = Hits()
        self.b = Hits()
        self.n = 0

    def forward(self, x):
        self.n += 1
        return self.b(self.a(x))


@pytest.mark.parametrize("region", [False, True])
@pytest.mark.parametrize("warmups", [1, 2])
def test_piecewise_held_counters_control(sim, region, warmups):
    torch.manual_seed(0)
    ref = Root()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(5):
            with (cg.graph_region() if region else contextlib.nullcontext()):
                x = torch.randn(2, 4)
                assert close(g(x), ref(x)), i
                assert torch.equal(g.a.hits, ref.a.hits), i
                assert torch.equal(g.b.hits, ref.b.hits), i
                assert g.n == ref.n, i


@pytest.mark.parametrize("warmups", [1, 2])
def test_training_held_counter_control(sim, warmups):
    torch.manual_seed(0)
    ref = Hits()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    for i in range(4):
        x = torch.randn(2, 4)
        a, b = g(x), ref(x)
        assert close(a, b), i
        assert torch.equal(g.hits, ref.hits), i
        a.sum().backward()
        b.sum().backward()
        assert close(g.lin.weight.grad, ref.lin.weight.grad), i


class AddHeld(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.buf = torch.zeros(100)

    def forward(self, x):
        self.buf[:4].add_(1)
        return self.lin(x) + x.sum()


@pytest.mark.parametrize("off", [0, 8])
def test_argument_view_of_held_with_offset_control(sim, off):
    torch.manual_seed(0)
    ref = AddHeld()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
        for i in range(3):
            a = g(g.buf[off:off + 8].view(2, 4))
            b = ref(ref.buf[off:off + 8].view(2, 4))
            assert close(a, b), i
            assert torch.equal(g.buf, ref.buf), i


class ReturnsHeld(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = torch.zeros(100)

    def forward(self, x):
        self.acc[:4].add_(self.lin(x).sum(0))
        return self.acc


@pytest.mark.parametrize("warmups", [1, 3])
@pytest.mark.parametrize("region", [False, True])
def test_held_tensor_returned_control(sim, warmups, region):
    torch.manual_seed(0)
    ref = ReturnsHeld()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            with (cg.graph_region() if region else contextlib.nullcontext()):
                x = torch.randn(2, 4)
                assert close(g(x), ref(x)), i
                assert torch.equal(g.acc, ref.acc), i


class NS(nn.Module):
    def __init__(self, rebind: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cfg = types.SimpleNamespace(step=0)
        self.st = {"step": 0}
        self.rebind = rebind

    def forward(self, x):
        if self.rebind:
            self.st = dict(self.st, step=self.st["step"] + 1)
        else:
            self.cfg.step += 1
        return self.lin(x)


@pytest.mark.parametrize("rebind", [False, True])
@pytest.mark.parametrize("warmups", [1, 3])
def test_object_or_rebound_dict_attribute_control(sim, warmups, rebind):
    torch.manual_seed(0)
    ref = NS(rebind)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert g.cfg.step == ref.cfg.step and g.st == ref.st, i


def test_closure_counter_control(sim):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    step = 0

    def f(x):
        nonlocal step
        step += 1
        return lin(x)

    g = cg.graphify(f, num_warmup_iters=3)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), lin(x)), i
            assert step == i + 1, (i, step)


class Counted(Hits):
    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, x):
        self.n += 1
        return super().forward(x)


@pytest.mark.parametrize("before", [0, 1, 3])
def test_explain_on_a_graphified_module_control(sim, before):
    torch.manual_seed(0)
    ref = Counted()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(before):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
        cg.explain(g, torch.randn(2, 4))
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.hits, ref.hits) and g.n == ref.n, i


@pytest.mark.parametrize("warmups", [1, 3])
def test_inference_tensor_held_counter_control(sim, warmups):
    torch.manual_seed(0)
    with torch.inference_mode():
        ref = Hits()
        g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.hits, ref.hits), i
