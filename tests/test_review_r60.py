"""Review of aa9f958, fad52b5, 8c33b30, d1e3dc6, da0d8f1, 101282d (held tensors copied and put
back by storage around the extra warm-ups, the capture and a rehearsal; share_graph's held-write
refusal; bucketed's four states per size), on the simulated backend.

Tests named ``test_finding_*`` failed on the code reviewed (one per finding: two crashes those
commits made, A and B; the rest older); all eight were fixed after the review. The others are
controls. Every comparison is with eager PyTorch on a copy of the module.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

import cudagraphify as cg
from conftest import SimBackend  # noqa: F401 (the fixtures' backend)
from test_engine import _trusting, faithful  # noqa: F401 (a fixture)
from test_share_engine import _distinct, _register, reading  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("quiet")


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


class Hits(nn.Module):
    """Counts its calls in a plain tensor attribute (not a buffer), written in place."""

    def __init__(self, n: int = 100):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hits = torch.zeros(n)

    def forward(self, x):
        self.hits.add_(1)
        return self.lin(x) + self.hits.sum()


# -- F-A (crash, introduced by aa9f958 + da0d8f1): a tensor subclass kept as an attribute -------


class SubclassAttr(nn.Module):
    """Reads a wrapper tensor subclass (torchao's quantized weights, DTensor, ...) kept as a
    plain attribute; writes nothing."""

    def __init__(self):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor

        self.lin = nn.Linear(4, 4)
        self.t2 = TwoTensor(torch.ones(100), torch.ones(100))  # (not a small CPU tensor)

    def forward(self, x):
        return (self.lin(x) * self.t2[:4]).a


@pytest.mark.parametrize("warmups", [1, 3])
def test_finding_a_held_wrapper_subclass_first_call_raises(sim, warmups):
    """``_writes.undone`` reads ``untyped_storage().data_ptr()`` of every held tensor, which a
    wrapper subclass does not have: the user's first call raises out of ``capture()`` (before
    these commits the capture failed and the call ran piecewise, right)."""
    torch.manual_seed(0)
    ref = SubclassAttr()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i


# -- F-B (crash, introduced by aa9f958): copying the held tensors for the capture runs OOM ------


@pytest.mark.parametrize("reads_only", [False, True])
def test_finding_b_held_copy_out_of_memory_escapes_the_first_call(sim, monkeypatch, reads_only):
    """Every held tensor's whole storage is now cloned around every capture (read-only ones
    too). Where that clone does not fit (a large tensor kept as a plain attribute on a full
    GPU: simulated here by the clone raising torch.OutOfMemoryError), the error leaves
    ``Capturing.capture`` outside its try: the user's call raises though its real call ran
    (and wrote the counter)."""
    torch.manual_seed(0)

    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.table = torch.randn(100)

        def forward(self, x):
            return self.lin(x) + self.table[:4]

    ref = Table() if reads_only else Hits()
    g = cg.graphify(copy.deepcopy(ref))
    orig = torch.UntypedStorage.clone

    def clone(self):
        if sys._getframe(1).f_code.co_filename.endswith("_writes.py"):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: the held copy)")
        return orig(self)

    monkeypatch.setattr(torch.UntypedStorage, "clone", clone)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            if not reads_only:
                assert torch.equal(g.hits, ref.hits), i


# -- F-C (wrong values): a chaining graph_region replays the first call's graph once more ------


@pytest.mark.parametrize("n", [4, 100])
def test_finding_c_region_first_call_writes_held_twice(sim, n):
    """In a chaining region the first call's outcome has ``replay=True`` unless the forward
    wrote its inputs or statics: a write to a held tensor (a counter kept as a plain
    attribute) is not in that condition, so the real call and the replay both apply it."""
    torch.manual_seed(0)
    ref = Hits(n)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(3):
            with cg.graph_region():
                x = torch.randn(2, 4)
                assert close(g(x), ref(x)), i
                assert torch.equal(g.hits, ref.hits), (i, g.hits[:2], ref.hits[:2])


def test_finding_c_region_chain_of_two(sim):
    torch.manual_seed(0)
    a, b = Hits(), nn.Linear(4, 4)
    ra, rb = copy.deepcopy(a), copy.deepcopy(b)
    cg.graphify(a)
    cg.graphify(b)
    with torch.no_grad(), cg.graph_region():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(b(a(x)), rb(ra(x))), i
            assert torch.equal(a.hits, ra.hits), i


# -- F-D (wrong values): a captured path that writes a held tensor the eager one does not ------


class WritesHeldWhenCaptured(nn.Module):
    """Trusted capture-aware code (its eager path syncs: planned on a rehearsal) whose captured
    path writes a plain tensor attribute that its eager path never writes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.count = torch.zeros(100)

    def forward(self, x):
        if torch.cuda.is_current_stream_capturing():
            self.count.add_(1)
        elif bool((x > -1e9).all()):  # a host sync
            pass
        return self.lin(x) + self.count[:4]


def test_finding_d_rehearsal_accepts_a_held_write_only_on_the_captured_path(faithful):
    """``rehearse`` refuses a captured path that writes a buffer or input the eager path does
    not (tests/test_engine.py), and puts held tensors back, but never compares what it wrote
    in them: every replay adds one where eager adds none."""
    torch.manual_seed(0)
    ref = WritesHeldWhenCaptured()
    g = cg.graphify(copy.deepcopy(ref), op_policy=_trusting(__name__))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert torch.equal(g(x), ref(x)), i
            assert torch.equal(g.count, ref.count), (i, g.count[:2], ref.count[:2])


# -- F-E (wrong state): the extra warm-ups' module attribute writes stay ----------------------


class Count(nn.Module):
    """Counts its calls in a Python int attribute (a step counter)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.n = 0

    def forward(self, x):
        self.n += 1
        return self.lin(x)


def test_finding_e_extra_warmups_keep_attribute_writes(sim):
    """``_extra_warmups`` puts back parameters, buffers and held tensors ("so only its effect
    remains"), not the module attributes the runs set: after one call with
    num_warmup_iters=3 the counter says 3."""
    torch.manual_seed(0)
    ref = Count()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=3)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert g.n == ref.n, (i, g.n, ref.n)


def test_finding_e_training_default_options_count_one_more(sim):
    """Training always runs one extra warm-up (its backward): with default options the
    counter is one ahead of eager from the first step on."""
    torch.manual_seed(0)
    ref = Count()
    g = cg.graphify(copy.deepcopy(ref))
    for i in range(3):
        x = torch.randn(2, 4)
        out, want = g(x), ref(x)
        assert close(out, want), i
        assert g.n == ref.n, (i, g.n, ref.n)
        out.sum().backward()
        want.sum().backward()


# -- F-F (wrong state): a failed capture keeps its run's attribute writes ---------------------


_BACKEND: list = [None]


class RaisesWhenCaptured(nn.Module):
    """Writes a held counter and an int attribute, then fails while captured (an op a capture
    refuses)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hits = torch.zeros(100)
        self.n = 0

    def forward(self, x):
        self.hits.add_(1)
        self.n += 1
        if _BACKEND[0] is not None and _BACKEND[0].in_capture():
            raise RuntimeError("operation not permitted when stream is capturing")
        return self.lin(x)


def test_finding_f_failed_capture_keeps_attribute_writes(sim):
    """The held counter is put back (``undone``), but ``_capture``'s failure path never undoes
    the module attributes the capture's run set (verify's ``rec.undo()`` was not reached)."""
    torch.manual_seed(0)
    ref = RaisesWhenCaptured()
    g = cg.graphify(copy.deepcopy(ref))
    _BACKEND[0] = sim
    try:
        with torch.no_grad():
            for i in range(3):
                x = torch.randn(2, 4)
                assert close(g(x), ref(x)), i
                assert torch.equal(g.hits, ref.hits), i
                assert g.n == ref.n, (i, g.n, ref.n)
    finally:
        _BACKEND[0] = None


# -- F-G (crash, left open): a sparse tensor kept as an attribute -----------------------------


class SparseAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sp = torch.eye(4).to_sparse()

    def forward(self, x):
        return self.lin(x) + torch.sparse.mm(self.sp, x.t()).t()


def test_finding_g_sparse_held_tensor_first_call_raises(sim):
    """The guard's per-call check of a held tensor reads ``data_ptr()``, which a sparse tensor
    does not have: the first call raises (da0d8f1's ``undone`` says sparse ones are left
    alone; were the guard fixed, their writes by the extra warm-ups would then stay)."""
    torch.manual_seed(0)
    ref = SparseAttr()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i


# -- F-H (speed): bucketed over a function that runs a module in train mode once --------------


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


def test_finding_h_bucketed_function_train_call_refuses_the_eval_size(sim):
    """fad52b5 puts the target's training flag in the key: a graphified function (a serving
    step closing over the model) has none, so one call with the model in train mode refuses
    the eval size for good (every later call runs unpadded)."""
    torch.manual_seed(0)
    m = Drop().eval()
    g = cg.graphify(lambda x: m(x))
    b = cg.bucketed(g, [4])
    with torch.no_grad():
        for i in range(2):
            x = torch.randn(3, 4)
            assert close(b(x), m(x)), i
        m.train()
        b(torch.randn(3, 4))
        m.eval()
        for i in range(2):
            x = torch.randn(3, 4)
            assert close(b(x), m(x)), i
    assert not b.refused, list(b.refused.values())


# -- controls ------------------------------------------------------------------------------


class OffsetView(nn.Module):
    """Writes a view with a storage offset of a plain tensor attribute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.base = torch.zeros(120)
        self.view = self.base[40:44]

    def forward(self, x):
        self.view.add_(1)
        return self.lin(x) + self.view


@pytest.mark.parametrize("warmups", [1, 3])
def test_held_view_with_offset_control(sim, warmups):
    torch.manual_seed(0)
    ref = OffsetView()
    torch.manual_seed(0)
    g = cg.graphify(OffsetView(), num_warmup_iters=warmups)  # (deepcopy would split the view)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.base, ref.base), i
    assert cg.stats(g).replays > 0


class ParamView(nn.Module):
    """Writes a parameter through a view kept as a plain attribute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bv = self.lin.bias.data[1:3]

    def forward(self, x):
        self.bv.mul_(0.5)
        return self.lin(x)


@pytest.mark.parametrize("warmups", [1, 3])
def test_held_view_of_a_parameter_control(sim, warmups):
    torch.manual_seed(0)
    ref = ParamView()
    torch.manual_seed(0)
    g = cg.graphify(ParamView(), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.lin.bias, ref.lin.bias), i


@pytest.mark.parametrize("warmups", [2, 3])
def test_raise_in_extra_warmup_puts_held_back_control(sim, warmups):
    torch.manual_seed(0)
    acc, lin, calls = torch.zeros(4), nn.Linear(4, 4), [0]

    def f(x):
        calls[0] += 1
        acc.add_(1)
        if calls[0] == 2:  # the first extra warm-up
            raise ValueError("boom")
        return lin(x) + acc

    g = cg.graphify(f, num_warmup_iters=warmups)
    want = torch.zeros(4)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            want.add_(1)
            assert close(g(x), lin(x) + want), i
            assert torch.equal(acc, want), i


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Hits()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.inner(x))


@pytest.mark.parametrize("warmups", [1, 3])
def test_nested_graphify_held_counter_control(sim, warmups):
    torch.manual_seed(0)
    ref = Outer()
    m = copy.deepcopy(ref)
    cg.graphify(m.inner, num_warmup_iters=warmups)
    cg.graphify(m, num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(2, 4)
            assert close(m(x), ref(x)), i
            assert torch.equal(m.inner.hits, ref.inner.hits), i


class Scaled(nn.Module):
    """Each layer reads a read-only tensor of its own kept as a plain attribute."""

    def __init__(self, n: int):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = torch.randn(n)

    def forward(self, x):
        return self.lin(x) * self.table[:4]


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("n", [4, 100])
def test_share_graph_per_layer_read_only_held_control(reading, strict, n):
    torch.manual_seed(0)
    layers = _distinct(nn.ModuleList([Scaled(n) for _ in range(3)]))
    ref = copy.deepcopy(layers)
    _register(*layers)
    cg.share_graph(layers, strict=strict)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(2, 4)
            for k, (layer, twin) in enumerate(zip(layers, ref)):
                assert close(layer(x), twin(x)), (step, k)


def test_region_read_only_held_control(sim):
    torch.manual_seed(0)
    ref = Scaled(100)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(3):
            with cg.graph_region():
                x = torch.randn(2, 4)
                assert close(g(x), ref(x)), i


class Flag(nn.Module):
    """A mode flag: 0-3 keep rows apart, 4 centres over the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mode = 0

    def forward(self, x):
        y = self.lin(x) * (1 + self.mode)
        if self.mode == 4:
            y = y - y.mean(0, keepdim=True)
        return y


def test_bucketed_flag_flips_control(sim):
    torch.manual_seed(0)
    m = Flag().eval()
    ref = copy.deepcopy(m)
    b = cg.bucketed(cg.graphify(m), [4])
    with torch.no_grad():
        for mode in [0, 1, 0, 1, 2, 3, 2, 0]:
            m.mode = ref.mode = mode
            x = torch.randn(3, 4)
            assert close(b(x), ref(x)), mode
        assert not b.refused
        (ran,) = b.verified.values()
        assert len(ran.states) == 4
        m.mode = ref.mode = 4  # rows interact: refused, right
        for i in range(2):
            x = torch.randn(3, 4)
            assert close(b(x), ref(x)), i
    assert b.refused
