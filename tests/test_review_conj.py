"""Review of ccf92fa (``StaticInputs._build``: the static copy of a conj or neg view argument is
a conj or neg view itself, so ops that read the bit, ``resolve_conj`` first, do on the copy
what they do on the argument). CPU, on the simulated backend (``sim``).

Plain tests pin down what the change gets right: every output equal to eager's bit for bit,
with eager's dtype, strides, conj/neg bits and aliasing (new memory or the argument's), and
arguments written in place as eager writes them (modules, matmul, FFT, in-place ops through a
conj or neg view, ``out=`` a conj view, expanded and strided conj views, calls alternating
conj and plain arguments, the same memory passed twice, ``copy_outputs=False``, autograd,
``capture_sizes``, ``bucketed``, a conj ``nn.Parameter`` argument).

Finding (fixed since; its test plain):

- C1 (pre-existing, left by the change) ``graph_region`` chaining: ``GraphRegion.borrowable``
  matches a leaf with a slot by address, shape, stride and dtype only, so ``g2(h.conj())`` (or
  a neg view of ``h``), ``h`` an output handed out by an earlier graph of the region, is read
  in place as the slot, a plain tensor: the graph computes on ``h``, not on its conjugate,
  silently, on every call (the capture included). Fix: borrow only a leaf whose conj and neg
  bits are the slot's (``x.is_conj() == slot.tensor.is_conj()`` and likewise ``is_neg``);
  such a leaf is then copied into a conj/neg static copy, as this commit makes it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg


def _c(*shape):
    return torch.randn(*shape, dtype=torch.complex64)


def _twin(a: torch.Tensor) -> torch.Tensor:
    """A copy of ``a``'s whole storage, viewed as ``a`` is (layout, conj and neg bits), so that
    eager's writes through it can be compared with the replay's."""
    b, conj, neg = a, a.is_conj(), a.is_neg()
    if conj:
        b = b.conj()
    if neg:
        b = torch._neg_view(b)
    t = torch.empty(0, dtype=b.dtype).set_(a.untyped_storage().clone(), b.storage_offset(),
                                           b.size(), b.stride())
    if neg:
        t = torch._neg_view(t)
    if conj:
        t = t.conj()
    return t


def _meta(t):
    return (t.shape, t.dtype, t.stride(), t.is_conj(), t.is_neg())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and _meta(a) == _meta(b) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _mem(t) -> int:
    return t.untyped_storage().data_ptr()


def _compare(g, fn, make, n=4, grad=False):
    """Calls ``g`` and ``fn`` on twins of ``make()`` n times: outputs, arguments after the call
    and which arguments each output aliases, as eager's; then the replays (n - 1)."""
    with torch.enable_grad() if grad else torch.no_grad():
        for i in range(n):
            args = make()
            twins = tuple(_twin(a) if isinstance(a, torch.Tensor) else a for a in args)
            got, want = g(*args), fn(*twins)
            assert _same(got, want), (i, cg.stats(g))
            for a, b in zip(args, twins):
                if isinstance(a, torch.Tensor):
                    assert _same(a, b), (i, "argument written otherwise than eager's")
            outs = [got] if isinstance(got, torch.Tensor) else \
                [t for t in got or () if isinstance(t, torch.Tensor)]
            wants = [want] if isinstance(want, torch.Tensor) else \
                [t for t in want or () if isinstance(t, torch.Tensor)]
            for o, w in zip(outs, wants):
                for a, b in zip(args, twins):
                    if isinstance(a, torch.Tensor):
                        assert (_mem(o) == _mem(a)) == (_mem(w) == _mem(b)), (i, "aliasing")
    s = cg.stats(g)
    assert s.replays >= n - 1 and s.eager == 0, s


# -- what the change gets right (plain tests) ------------------------------------------------

_neg = torch._neg_view

_CASES = {
    "resolve_conj": (torch.resolve_conj, lambda: (_c(4, 8).conj(),)),
    "resolve_neg": (torch.resolve_neg, lambda: (_neg(torch.randn(4, 8)),)),
    "resolve_conj of conj+neg": (torch.resolve_conj, lambda: (_neg(_c(4, 8)).conj(),)),
    "resolve both": (lambda z: z.resolve_conj().resolve_neg(), lambda: (_neg(_c(4, 8).conj()),)),
    "view_as_real of resolved": (lambda z: torch.view_as_real(z.resolve_conj()) * 2,
                                 lambda: (_c(4, 8).conj(),)),
    "is_conj branch": (lambda z: z * 2 if z.is_conj() else z * 3, lambda: (_c(4, 8).conj(),)),
    "imag of conj (a neg view)": (lambda z: z.imag * 2, lambda: (_c(4, 8).conj(),)),
    "clone of conj": (torch.clone, lambda: (_c(4, 8).conj(),)),
    "clone of neg": (torch.clone, lambda: (_c(4, 8).conj().imag,)),
    "contiguous of conj": (lambda z: z.contiguous(), lambda: (_c(4, 8).conj(),)),
    "matmul conj @ plain": (torch.matmul, lambda: (_c(4, 8).conj(), _c(8, 3))),
    "matmul plain @ mH": (torch.matmul, lambda: (_c(4, 8), _c(3, 8).mH)),
    "fft of conj": (torch.fft.fft, lambda: (_c(4, 8).conj(),)),
    "rfft of neg": (torch.fft.rfft, lambda: (_neg(torch.randn(4, 8)),)),
    "to complex128": (lambda z: z.to(torch.complex128), lambda: (_c(4, 8).conj(),)),
    "sum": (lambda z: z.sum(), lambda: (_c(4, 8).conj(),)),
    # returned as is, or a view of it: the caller's memory, with eager's bits
    "identity conj": (lambda z: z, lambda: (_c(4, 8).conj(),)),
    "conj of conj": (lambda z: z.conj(), lambda: (_c(4, 8).conj(),)),
    "slice of conj": (lambda z: z[1:3], lambda: (_c(4, 8).conj(),)),
    "t of conj": (lambda z: z.t(), lambda: (_c(4, 8).conj(),)),
    "detach of neg": (lambda z: z.detach(), lambda: (_neg(torch.randn(4, 8)),)),
    # layouts: strided, transposed, expanded (the overlapping branch: a compact copy)
    "strided conj": (torch.resolve_conj, lambda: (_c(8, 8)[:, ::2].conj(),)),
    "transposed conj": (torch.resolve_conj, lambda: (_c(8, 4).t().conj(),)),
    "expanded conj": (torch.resolve_conj, lambda: (_c(1, 8).conj().expand(4, 8),)),
    "expanded conj * 2": (lambda z: z * 2, lambda: (_c(1, 8).conj().expand(4, 8),)),
    # the same memory twice
    "the same conj view twice": (torch.mul, lambda: (lambda z: (z, z))(_c(4, 8).conj())),
    "z and z.conj()": (torch.add, lambda: (lambda z: (z, z.conj()))(_c(4, 8))),
    # written in place through the view: eager's values land in the caller's base
    "mul_ a conj view": (torch.Tensor.mul_, lambda: (_c(4, 8).conj(), _c(4, 8))),
    "add_ 1j to a conj view": (lambda z: z.add_(1j), lambda: (_c(4, 8).conj(),)),
    "add_ to a neg view": (torch.Tensor.add_, lambda: (_neg(torch.randn(4, 8)), torch.randn(4, 8))),
    "add_ to conj(z).imag": (lambda z: (z.imag.add_(1), None)[1], lambda: (_c(4, 8).conj(),)),
    "copy_ into a conj view": (lambda z, y: z.copy_(y), lambda: (_c(4, 8).conj(), _c(4, 8))),
    "out= a conj view": (lambda a, b, o: torch.add(a, b, out=o),
                         lambda: (_c(4, 8), _c(4, 8), _c(4, 8).conj())),
    "out= a neg view": (lambda a, b, o: torch.add(a, b, out=o),
                        lambda: (torch.randn(4, 8), torch.randn(4, 8), _neg(torch.randn(4, 8)))),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_a_conj_or_neg_view_argument_gives_eagers_result(sim, name):
    fn, make = _CASES[name]
    _compare(cg.graphify(fn), fn, make)


def test_a_complex_linear_on_a_conj_view(sim):
    torch.manual_seed(0)
    m = nn.Linear(8, 3, dtype=torch.complex64)
    ref = copy.deepcopy(m)
    _compare(cg.graphify(m), ref, lambda: (_c(4, 8).conj(),))


@pytest.mark.parametrize("copy_outputs", [True, False])
def test_conj_and_plain_arguments_alternating_are_two_keys_each_eagers(sim, copy_outputs):
    g = cg.graphify(torch.resolve_conj, copy_outputs=copy_outputs)
    with torch.no_grad():
        for i in range(8):
            z = _c(4, 8).conj() if i % 2 else _c(4, 8)
            zt = _twin(z)
            got, want = g(z), torch.resolve_conj(zt)
            assert _same(got, want)
            # eager's is new memory for a conj view, the argument itself for a plain tensor
            assert (got is z) == (want is zt) and (_mem(got) == _mem(z)) == (_mem(want) == _mem(zt))
    s = cg.stats(g)
    assert (s.captures, s.replays, s.eager) == (2, 6, 0), s


def test_copy_outputs_false_conj_output_of_a_conj_argument(sim):
    fn = lambda z: (z * 2).conj()  # noqa: E731
    _compare(cg.graphify(fn, copy_outputs=False), fn, lambda: (_c(4, 8).conj(),))


def test_a_conj_parameter_argument_stays_one(sim):
    fn = lambda z: (z * 2, type(z).__name__, z.is_conj(), torch.resolve_conj(z))  # noqa: E731
    g = cg.graphify(fn)
    with torch.no_grad():
        for _ in range(4):
            base = _c(4, 8)
            z = nn.Parameter(base.conj(), requires_grad=False)
            zt = nn.Parameter(base.clone().conj(), requires_grad=False)
            assert _same(g(z), fn(zt))
    assert cg.stats(g).replays == 3


@pytest.mark.parametrize("leaf", [False, True], ids=["w.conj()", "conj leaf"])
def test_gradients_through_a_conj_view_argument_are_eagers(sim, leaf):
    torch.manual_seed(0)
    m = nn.Linear(8, 3, dtype=torch.complex64)
    ref = copy.deepcopy(m)
    g = cg.graphify(m)
    for _ in range(4):
        w = _c(4, 8)
        if leaf:
            z, zt = w.conj().requires_grad_(), w.clone().conj().requires_grad_()
            a, b = z, zt
        else:
            a, b = w.requires_grad_(), w.detach().clone().requires_grad_()
            z, zt = a.conj(), b.conj()
        out, want = g(z), ref(zt)
        assert torch.equal(out, want)
        gout = _c(4, 3)
        (out * gout).real.sum().backward()
        (want * gout).real.sum().backward()
        assert torch.equal(a.grad, b.grad) and a.grad.is_conj() == b.grad.is_conj()
        assert torch.equal(m.weight.grad, ref.weight.grad)
        assert torch.equal(m.bias.grad, ref.bias.grad)
        m.zero_grad()
        ref.zero_grad()
    assert cg.stats(g).replays == 3


def test_capture_sizes_of_conj_arguments(sim):
    g = cg.graphify(torch.resolve_conj)
    with torch.no_grad():
        cg.capture_sizes(g, lambda n: (_c(n, 4).conj(),), [2, 4], progress=False)
        for n in (2, 4, 2):
            z = _c(n, 4).conj()
            got = g(z)
            assert _same(got, torch.resolve_conj(_twin(z))) and _mem(got) != _mem(z)
    s = cg.stats(g)
    assert (s.captures, s.eager) == (2, 0) and s.replays >= 3, s


def test_bucketed_refuses_a_forward_that_reads_the_conj_bit(sim):
    # (padding by torch.cat makes a plain tensor: the forward's branch differs, and the bucket's
    # check against eager on the call's own rows sees it: those sizes run unpadded)
    fn = lambda z: z * 2 if z.is_conj() else z * 3  # noqa: E731
    b = cg.bucketed(cg.graphify(fn), [4, 8])
    with torch.no_grad():
        for n in (3, 3, 3, 5, 5, 5):
            z = _c(n, 6).conj()
            assert _same(b(z), fn(_twin(z)))
    assert b.refused


# -- finding C1 (fixed) ------------------------------------------------------------------

@pytest.mark.parametrize("view", ["conj", "neg"])
def test_c1_region_chain_with_a_conj_or_neg_view_of_an_output(sim, view):
    real = view == "neg"
    make = (lambda: torch.randn(4, 8)) if real else (lambda: _c(4, 8))
    bits = torch._neg_view if real else torch.conj
    f1, f2 = (lambda x: x * 2), (lambda x: x + 1)
    g1, g2 = cg.graphify(f1), cg.graphify(f2)
    with torch.no_grad(), cg.graph_region():
        for i in range(4):
            x = make()
            got = g2(bits(g1(x)))
            want = f2(bits(f1(x)))
            assert _same(got, want), (i, view)
    assert cg.stats(g2).replays >= 3
