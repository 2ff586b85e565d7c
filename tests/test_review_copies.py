"""Review 14: copies of graph-memory outputs (cudagraphify/_copies.py) and the other output
fixes of 7558124..HEAD (argument views, training duplicates, metadata side effects).

CPU tests on the simulated backend (tests/conftest.py). Findings are xfail(strict=True) tests
comparing with eager; controls are plain tests. Replay counters prove the graphed path was
taken. GPU reproductions: .device/review14/."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import cudagraphify as cg
from test_review_outputs import _Piecewise as _PiecewiseBase, piecewise_calls


def _replayed(f, n=3):
    s = cg.stats(f)
    assert s.replays == n and not s.eager_calls, s


def _run(g, make, n=4, **options):
    f = cg.graphify(g, **options)
    with torch.no_grad():
        for _ in range(n):
            x = make()
            out = f(x)
        want = g(x)
    return f, x, out, want


def _same(o, w) -> bool:
    """Bitwise equal, same dtype, shape, strides and conj/neg bits."""
    if not isinstance(o, torch.Tensor):
        return o == w
    if (o.dtype, o.shape, o.stride(), o.is_conj(), o.is_neg()) != \
            (w.dtype, w.shape, w.stride(), w.is_conj(), w.is_neg()):
        return False
    a, b = o.resolve_conj().resolve_neg(), w.resolve_conj().resolve_neg()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                       b.reshape(-1).contiguous().view(torch.uint8)) if a.numel() else True


def _all_same(out, want) -> bool:
    ol, wl = pytree.tree_leaves(out), pytree.tree_leaves(want)
    return len(ol) == len(wl) and all(_same(o, w) for o, w in zip(ol, wl))


def _raises(fn) -> str | None:
    try:
        fn()
    except RuntimeError as e:
        return str(e)[:80]
    return None


# -- C1: outputs rebuilt from one copy are views made under no_grad ---------------------------
# (_copies.rebuild: ``mem.view(dtype).as_strided(...)`` of a uint8 copy, made in the caller's
# no_grad: eager's ``y`` is a plain tensor, the graphed one a view with NO_GRAD creation meta;
# ``detach_()`` and an in-place op with a tensor that requires grad, in grad mode, raise)

def _base_and_view(x):
    y = x * 2
    return y, y.t()


# (fixed: finding C1: an output rebuilt from the span copy is a view made under no_grad
# (eager's is not a view): detach_() and an in-place op with a tensor that requires grad raise)
def test_c1_a_rebuilt_output_is_not_a_no_grad_view(sim):
    f, x, out, want = _run(_base_and_view, lambda: torch.randn(3, 4))
    _replayed(f)
    assert _all_same(out, want)
    w = torch.randn((), requires_grad=True)
    assert _raises(lambda: want[0].mul_(w)) is None  # eager: fine
    assert out[0]._is_view() == want[0]._is_view()  # eager False
    assert _raises(lambda: out[0].mul_(w)) is None  # graphed: "A view was created in no_grad"


# (fixed: finding C1: detach_() of a rebuilt output raises 'Can't detach views in-place'
# (eager's output is not a view))
def test_c1_detach_in_place_of_a_rebuilt_output(sim):
    f, x, out, want = _run(_base_and_view, lambda: torch.randn(3, 4))
    _replayed(f)
    want[0].detach_()
    out[0].detach_()


class _Piecewise(_PiecewiseBase):
    def forward(self, x):
        h = self.a(x)
        h.sum().item()  # refused: the root is piecewise
        y = self.b(h)
        return y, y.t(), y[0], {"h": h[:, ::2]}


def _piecewise_calls():
    out, want, g = piecewise_calls(_Piecewise)
    assert _all_same(out, want)
    return out, want, g


# (fixed: finding C1 (copies_of, a piecewise root's owned outputs): the root's output was a
# no_grad view of the span copy)
def test_c1_piecewise_root_output_is_not_a_no_grad_view(sim, quiet):
    out, want, _ = _piecewise_calls()
    w = torch.randn((), requires_grad=True)
    want[0].mul_(w)
    out[0].mul_(w)


def test_c1_control_piecewise_root_outputs_alias_as_eagers(sim, quiet):
    out, want, _ = _piecewise_calls()
    with torch.no_grad():
        out[0].add_(1)
        want[0].add_(1)
    assert _all_same(out, want)  # y.t() and y[0] follow y


# -- C2: an argument detached, or a view of it detached, comes back as a view of the argument -

def _detached(x):
    return x.detach(), x.detach()[1:], x * 2


# (fixed: finding C2: x.detach()[1:] comes back as a view of the caller's x (_view_of_input:
# `detached = not out._is_view()` misses a view of a detached alias): under no_grad it requires
# grad (eager: no), so numpy() raises and an in-place op in grad mode raises on a leaf)
def test_c2_a_view_of_a_detached_argument_does_not_require_grad(sim):
    f, x, out, want = _run(_detached, lambda: torch.randn(3, 4, requires_grad=True))
    _replayed(f)
    assert _all_same(out, want)
    assert want[1].requires_grad is False
    assert out[1].requires_grad is False  # graphed: True, a leaf of its own
    out[1].numpy()


# (fixed: finding C2: x.detach() comes back as an as_strided view of the detached alias, made
# under no_grad: detach_() raises 'Can't detach views in-place' and an in-place op with a
# tensor requiring grad raises)
def test_c2_a_detached_argument_is_not_a_view(sim):
    f, x, out, want = _run(_detached, lambda: torch.randn(3, 4))
    _replayed(f)
    assert out[0]._is_view() == want[0]._is_view()  # eager False
    want[0].detach_()
    out[0].detach_()


def test_c2_control_views_of_the_argument_keep_eagers_dtype_and_bits(sim):
    def g(z):
        return z[1:], z.conj(), z.conj().t(), z.t(), z * 2
    f, x, out, want = _run(g, lambda: torch.randn(4, 2, dtype=torch.complex128))
    _replayed(f)
    assert _all_same(out, want)
    assert all(o.data_ptr() == w.data_ptr() for o, w in zip(out[:4], want[:4]))


# -- C3: an expanded argument's contiguous() comes back as the caller's expanded tensor ------

def _contiguous(x):
    return x.contiguous(), x.sum()


# (finding C3, fixed: x.contiguous() of an expanded argument is, on the graph's compact buffer,
# the buffer itself: plan_outputs took it for the argument returned and handed back the
# caller's expanded x, stride 0, its memory: a write through one element changed the caller's
# tensor; an output on an argument that overlaps itself now runs eagerly)
def test_c3_contiguous_of_an_expanded_argument_is_a_copy(sim, quiet):
    f, x, out, want = _run(_contiguous, lambda: torch.randn(3, 1).expand(3, 4))
    assert cg.stats(f).replays == 0
    assert torch.equal(out[0], want[0])
    base = x._base.clone()
    with torch.no_grad():
        out[0][1, 2] = 100.0
    assert torch.equal(x._base, base)
    assert out[0] is not x and out[0].stride() == want[0].stride() == (4, 1)


def test_c3_control_an_expanded_argument_returned_is_the_callers(sim, quiet):
    def g(x):
        return x, x * 2
    f, x, out, want = _run(g, lambda: torch.randn(3, 1).expand(3, 4))
    assert out[0] is x and torch.equal(out[1], want[1])
    assert "overlaps itself" in next(iter(cg.stats(f).eager_calls))


# -- C4: a tensor subclass output loses its type -------------------------------------------

class _MyT(torch.Tensor):
    pass


def _sub_views(x):
    y = (x * 2).as_subclass(_MyT)
    return y, y[0]


def _sub_strided(x):
    return (x * 2).as_subclass(_MyT)[:, ::2]


def _sub_arg(x):
    return x.as_subclass(_MyT), x * 2


# (finding C4, fixed: outputs rebuilt from a span copy or on an argument were plain Tensors, a
# subclass lost; such outputs now run eagerly)
@pytest.mark.parametrize("g", [_sub_views, _sub_strided, _sub_arg])
def test_c4_a_subclass_output_keeps_its_type(sim, quiet, g):
    f, x, out, want = _run(g, lambda: torch.randn(3, 4))
    out = out if isinstance(out, tuple) else (out,)
    want = want if isinstance(want, tuple) else (want,)
    assert [type(o) for o in out] == [type(w) for w in want]
    assert cg.stats(f).replays == 0
    assert "_MyT" in next(iter(cg.stats(f).eager_calls))


def test_c4_control_a_single_dense_subclass_output_keeps_its_type(sim):
    def g(x):
        return (x * 2).as_subclass(_MyT)
    f, x, out, want = _run(g, lambda: torch.randn(3, 4))
    _replayed(f)
    assert type(out) is _MyT and torch.equal(out, want)


# -- controls: what the copies get right ------------------------------------------------------

def _mixed_dtypes(x):
    y = x * 2
    return (y, y.view(torch.uint8)[3:], y.view(torch.int16)[1:], y.view(torch.bool)[5:9],
            y.view(torch.uint8)[-1], y[2:])


def test_control_mixed_dtypes_on_one_storage(sim):
    f, x, out, want = _run(_mixed_dtypes, lambda: torch.randn(8))
    _replayed(f)
    assert _all_same(out, want)
    with torch.no_grad():
        out[0].add_(1)
        want[0].add_(1)
    assert _all_same(out, want)  # every other output follows y
    assert len({o._version for o in out}) == 1


def test_control_complex_views_on_one_storage(sim):
    def g(z):
        y = z * 2
        return (torch.view_as_real(y), y[1:], y.conj()[2:], y.conj().imag[1:],
                torch.view_as_real(y)[1:, 1])
    for dt in (torch.complex64, torch.complex128):
        f, x, out, want = _run(g, lambda: torch.randn(5, dtype=dt))
        _replayed(f)
        assert _all_same(out, want)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float64])
def test_control_odd_offsets_and_the_storages_end(sim, dt):
    def g(x):
        y = x * 2
        return y[1:], y[3::2], y[-1], y[5:].view(3, 1).expand(3, 2)
    f, x, out, want = _run(g, lambda: torch.randn(8, dtype=dt))
    _replayed(f)
    assert _all_same(out, want)


def test_control_empty_and_zero_dim_outputs_beside_others(sim):
    def g(x):
        y = x * 2
        return y[:, :0], y[:0], y, y[1, 2], y.sum(), y[0, 0]
    f, x, out, want = _run(g, lambda: torch.randn(3, 4))
    _replayed(f)
    assert _all_same(out, want)


def test_control_the_same_output_twice_and_a_view_of_it(sim):
    def g(x):
        y = x * 2
        return y, y, y[0], {"a": y[1:], "b": y}, (y.t(), y.t())
    f, x, out, want = _run(g, lambda: torch.randn(3, 4))
    _replayed(f)
    assert _all_same(out, want)
    assert out[0] is out[1] is out[3]["b"] and out[4][0] is not out[4][1]
    with torch.no_grad():
        out[0].add_(1)
        want[0].add_(1)
    assert _all_same(out, want)


def test_control_zero_copy_outputs_keep_bits(sim):
    def g(z):
        y = z * 2
        return y.conj(), y.conj().imag, torch.view_as_real(y)[1:], y[::2]
    f, x, out, want = _run(g, lambda: torch.randn(6, dtype=torch.complex64),
                           copy_outputs=False)
    _replayed(f)
    assert _all_same(out, want)


def test_control_segments_outputs(segments):
    class S(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x).relu()
            h.sum().item()
            z = self.b(h) * 2 + 1
            return z, z[0], z.t(), z.view(torch.int32)[1:], z[:, ::2]

    torch.manual_seed(0)
    m = S().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = cg.graphify(copy.deepcopy(m), segments=True)
        with torch.no_grad():
            for _ in range(5):
                x = torch.randn(3, 8)
                out, want = g(x), m(x)
    assert cg.stats(g).segment_replays > 0 and _all_same(out, want)
    with torch.no_grad():
        out[0].add_(1)
        want[0].add_(1)
    assert _all_same(out, want)


class _TrainTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, {"a": y, "b": y * 2}, y


def test_control_training_one_tensor_three_times(sim):
    torch.manual_seed(0)
    ref = _TrainTwice()
    g = cg.graphify(copy.deepcopy(ref))

    def loss(o):
        return o[0].sum() + 3 * o[2].sum() + o[1]["a"].pow(2).sum() + o[1]["b"].sum()
    for _ in range(4):
        x = torch.randn(3, 4, requires_grad=True)
        out = g(x)
        loss(out).backward()
    xr = x.detach().clone().requires_grad_()
    loss(ref(xr)).backward()
    assert cg.stats(g).replays == 3
    assert out[0] is out[2] is out[1]["a"]
    assert torch.equal(x.grad, xr.grad)


def test_control_a_forward_that_restores_its_arguments_layout_is_graphed(sim):
    def g(x):
        x.t_()
        y = x * 2
        x.t_()
        return y
    f, x, out, want = _run(g, lambda: torch.randn(3, 4))
    _replayed(f)
    assert _same(out, want) and x.shape == (3, 4)


def test_control_an_attribute_set_before_the_call_is_not_a_side_effect(sim):
    def g(x):
        return x * 2

    def make():
        x = torch.randn(3, 4)
        x.meta = {"a": 1}
        return x
    f, x, out, want = _run(g, make)
    _replayed(f)


def test_control_inference_mode_outputs(sim):
    def g(x):
        y = x * 2
        return y, y[0], x[1], x.view(torch.int32)
    f = cg.graphify(g)
    with torch.inference_mode():
        for _ in range(4):
            x = torch.randn(3, 4)
            out = f(x)
        want = g(x)
    _replayed(f)
    assert _all_same(out, want) and all(o.is_inference() for o in out)


def test_control_spans_and_static_outputs_freed_by_ungraphify(sim):
    f = cg.graphify(_base_and_view)
    # (graphs of other tests may still be alive: one a strict xfail's traceback holds)
    before = {id(o) for o in gc.get_objects() if type(o).__name__ == "CapturedGraph"}
    with torch.no_grad():
        for _ in range(4):
            f(torch.randn(3, 4))
    refs = []
    for e in [o for o in gc.get_objects() if type(o).__name__ == "CapturedGraph"
              and id(o) not in before]:
        refs += [weakref.ref(t) for t in (e._spans or [])]
        refs += [weakref.ref(t) for t in e.output_tensors()]
    e = None
    assert refs
    cg.ungraphify(f)
    gc.collect()
    assert all(r() is None for r in refs)
