"""Review hunt 8: silent wrong results from tensor-level metadata of an ARGUMENT that a forward
reads in Python, which neither the signature (``_signature.build_signature`` /
``tensor_meta``: shape, strides, dtype, device, requires_grad, conj and neg bits) nor the probe
holds, and which the graph's static copy of the argument (``_replay.StaticInputs._build``) does
not share. CPU, on the simulated backend (``sim``); each scenario runs a graphified twin beside
an eager one (``copy.deepcopy`` before ``graphify``) and compares outputs bitwise.

The pattern of every finding: the first calls pass arguments whose metadata agrees with the
static copy's (a fresh contiguous tensor: offset 0, aligned, its own storage, no view, no
attribute, version 0 or >0 as the copy's), so the real call, the rehearsal and the capture all
take the same branch and the probe's two-run control-flow check sees nothing; the graph replays.
A later call passes a tensor with the SAME shape, strides, dtype and device (so the same
signature, the fast path) whose metadata differs: eager takes the other branch, the replay
returns the captured one. No error, no warning, no eager call. (Where the FIRST call already
differs from the copy, the probe sees the control flow differ and the root runs piecewise:
correct; that is why these hide.) Named tensors: not testable (torch 2.13 has no ``names``).

Findings (silent before the fix; each now a test of the fix, under no_grad and grad mode, for
a module and for a plain function ``cg.graphify(fn)``):

- H1 ``x.storage_offset()`` (``if x.storage_offset() > 0``; a view into a packed buffer).
- H2 ``x.data_ptr()`` used in Python (``if x.data_ptr() % 16``: an alignment check choosing a
  path, as vectorised-kernel dispatchers do).
- H3 ``x.untyped_storage()``: its ``nbytes()`` (a view of a larger buffer) and its
  ``data_ptr()`` compared with ``x.data_ptr()``.
- H4 ``x._version`` (``if x._version > 0``: "was this written in place before"): the copy's
  counter is moved by every copy-in.
- H5 ``x.is_shared()`` (a tensor in shared memory, ``share_memory_()``).
- H6 ``x._is_view()`` and ``x._base is None``.
- H7 a Python attribute of the argument tensor (``x.tag = "a"``; ``getattr(x, "tag", None)``:
  the tensor's own ``__dict__``, which no ``__torch_function__`` sees).
- H8 ``x.grad_fn is None``: a leaf argument requiring grad first, then a non-leaf one
  (``w * 1.0``: the same signature).
- H9 (a parameter, not an argument) ``self.w._version`` read in forward: an in-place write of
  the parameter between calls keeps the graph, as documented.

The fix (``_probe.Probe.read_metadata``): the probe refuses (PYTHON_STATE) a read of
``_probe.COPY_READS`` made by code outside torch on a tensor whose memory is a copied
argument's, a ``_version`` read on a parameter's or buffer's, and (through a
``Tensor.__getattr__`` patched while a probe runs) a Python attribute looked up and missing
on a copied argument; a first call whose copied argument carries attributes runs eagerly for
that signature (``_first_call``). A module's root then runs piecewise, a function eagerly.
More controls and the cases around them: tests/test_probe_metadata.py.

Controls (plain tests, pass, each proves a replay):
- the same eight predicates where the root runs piecewise (an ``.item()`` in the root): the
  predicate runs eagerly on the real argument and the graphed submodule replays:
  ``test_control_piecewise_root_reads_the_real_argument``;
- metadata the key holds, A-then-B on one graphify (a new signature, captured, then replayed):
  ``is_conj()``, ``is_neg()``, ``is_contiguous(memory_format=torch.channels_last)``,
  ``dim_order()``, ``element_size()``: ``test_control_metadata_the_key_holds`` (the replay
  is proven before the change for all, and after it for all but ``is_conj``/``is_neg``: the
  key holds the bit but the static copy drops it, so a forward branching on it sees another
  branch at capture, the probe's control-flow check catches it and that signature runs
  eagerly, with the reason: correct, never graphed; not silent, noted);
- ``x.is_leaf`` under no_grad still refused (fix 7b): ``test_control_is_leaf_refused``.

Also (no finding, a note): on the CPU double, a ``nn.Linear`` on a misaligned argument (offset
1 float) differs from its replay on the aligned static copy in the last bits (2e-7): eager's
BLAS picks another path for unaligned memory. A GPU could do the same (cuBLAS/cuDNN choose by
alignment); not pursued here (elementwise ops below to keep it out of the comparison).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("quiet")


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return x * self.w + 0.5


class Net(nn.Module):
    """Elementwise only (no BLAS: no alignment-dependent rounding in the comparison)."""

    def __init__(self, pred, item=False):
        super().__init__()
        self.inner = Inner()
        self.pred = pred
        self.item = item

    def forward(self, x):
        h = self.inner(x)
        if self.item:
            _ = h.sum().item()  # (a host sync: the root runs piecewise)
        if self.pred(x):
            return h * 2
        return h + 1


def _fresh():
    return torch.randn(4, 8)


def _tagged():
    t = torch.randn(4, 8)
    t.tag = "a"
    return t


def _written():
    return torch.randn(4, 8).add_(1)


# name -> (predicate, the first calls' argument (agrees with the static copy), the later one)
CASES = {
    "offset": (lambda x: x.storage_offset() > 0, _fresh,
               lambda: torch.randn(40)[8:].view(4, 8)),
    "data_ptr_align": (lambda x: x.data_ptr() % 16 != 0, _fresh,
                       lambda: torch.randn(41)[1:33].view(4, 8)),
    "storage_nbytes": (lambda x: x.untyped_storage().nbytes() > x.numel() * x.element_size(),
                       _fresh, lambda: torch.randn(64)[:32].view(4, 8)),
    "storage_ptr": (lambda x: x.untyped_storage().data_ptr() == x.data_ptr(), _fresh,
                    lambda: torch.randn(40)[8:].view(4, 8)),
    "version": (lambda x: x._version > 0, _written, _fresh),
    "is_shared": (lambda x: x.is_shared(), _fresh,
                  lambda: torch.randn(4, 8).share_memory_()),
    "is_view": (lambda x: x._is_view(), _fresh, lambda: torch.randn(4, 8)[:]),
    "base_is_none": (lambda x: x._base is None, _fresh, lambda: torch.randn(4, 8)[:]),
    "py_attribute": (lambda x: getattr(x, "tag", None) == "a", _fresh, _tagged),
}


def _twins(pred, fn, item=False):
    torch.manual_seed(0)
    ref = Net(pred, item)
    net = copy.deepcopy(ref)
    if fn:
        def forward(x):
            return net(x)
        return cg.graphify(forward), ref
    return cg.graphify(net), ref


def _run(g, ref, first, later, grad, n_first=3, n_later=2):
    """Calls ``n_first`` times with ``first()``, then ``n_later`` with ``later()``; returns per
    call (equal to eager, replays that call made)."""
    ctx = torch.enable_grad if grad else torch.no_grad
    out = []
    with ctx():
        for i in range(n_first + n_later):
            torch.manual_seed(i)
            x = (first if i < n_first else later)()
            r0 = cg.stats(g).replays
            a = g(x)
            b = ref(x)
            if grad:
                a.sum().backward(retain_graph=True)  # (a non-leaf argument's graph: twice)
                b.sum().backward(retain_graph=True)
            out.append((torch.equal(a.detach(), b.detach()), cg.stats(g).replays - r0))
    return out


def _st(g) -> str:
    s = cg.stats(g)
    return f"captures={s.captures} replays={s.replays} eager={dict(s.eager_calls)}"


# ============================== the fix ======================================================
# ``_probe.Probe.read_metadata``: a read of ``_probe.COPY_READS`` on a tensor whose memory is a
# copied argument's, made by code outside torch, is refused (PYTHON_STATE): a module's root
# runs piecewise (its submodules that make no such read stay graphed), a function eagerly.

OPS = {"offset": "Tensor.storage_offset", "data_ptr_align": "Tensor.data_ptr",
       "storage_nbytes": "Tensor.untyped_storage", "storage_ptr": "Tensor.untyped_storage",
       "version": "Tensor._version", "is_shared": "Tensor.is_shared",
       "is_view": "Tensor._is_view", "base_is_none": "Tensor._base",
       # (H7: a Python attribute looked for and missing, through the patched
       # ``Tensor.__getattr__``; one found where the copy has none takes another branch at
       # capture: the control-flow check)
       "py_attribute": "Tensor.tag"}


def _later_calls(case: str) -> int:
    """Calls with the later argument: an argument that carries attributes is another key for
    the piece it is passed to as well (``_signature.leaf_kind``), which then warms up and
    captures anew (under grad mode a training graph: its replay comes a call later)."""
    return 4 if case == "py_attribute" else 2


def _refused(g, op: str) -> bool:
    return any(f"{op} [PYTHON_STATE]" in k for k in cg.stats(g).eager_calls)


@pytest.mark.parametrize("mode", ["no_grad", "grad"])
@pytest.mark.parametrize("kind", ["module", "fn"])
@pytest.mark.parametrize("case", list(OPS))
def test_h_argument_metadata_read_is_refused(sim, case, kind, mode):
    pred, first, later = CASES[case]
    g, ref = _twins(pred, kind == "fn")
    calls = _run(g, ref, first, later, mode == "grad", n_later=_later_calls(case))
    assert all(ok for ok, _ in calls), f"{case}: {calls} {_st(g)}"
    assert _refused(g, OPS[case]), _st(g)
    if kind == "module":  # (the root reads it: its submodule is graphed, and replays)
        assert any(r for _, r in calls[3:]), f"no replay of the piece: {calls} {_st(g)}"
        assert any(k.startswith("piecewise") for k in cg.stats(g).eager_calls), _st(g)
    else:  # (a function has no pieces: it runs eagerly)
        assert cg.stats(g).replays == 0 and cg.stats(g).captures == 0, _st(g)


def _leaf():
    return torch.randn(4, 8).requires_grad_()


def _nonleaf():
    with torch.enable_grad():
        return torch.randn(4, 8, requires_grad=True) * 1.0


@pytest.mark.parametrize("mode", ["no_grad", "grad"])
@pytest.mark.parametrize("kind", ["module", "fn"])
def test_h8_grad_fn_of_an_argument_is_refused(sim, kind, mode):
    g, ref = _twins(lambda x: x.grad_fn is None, kind == "fn")
    calls = _run(g, ref, _leaf, _nonleaf, grad=mode == "grad")
    assert all(ok for ok, _ in calls), (calls, _st(g))
    assert _refused(g, "Tensor.grad_fn") or (
        mode == "grad" and any("PYTHON_HOOK" in k for k in cg.stats(g).eager_calls)), _st(g)


# ============================== controls ======================================================

@pytest.mark.parametrize("mode", ["no_grad", "grad"])
@pytest.mark.parametrize("case", list(CASES) + ["grad_fn"])
def test_control_piecewise_root_reads_the_real_argument(sim, case, mode):
    if case == "grad_fn":
        if mode == "grad":
            pytest.skip("grad_fn under grad mode is refused (PYTHON_HOOK)")
        pred, first, later = (lambda x: x.grad_fn is None), _leaf, _nonleaf
    else:
        pred, first, later = CASES[case]
    g, ref = _twins(pred, fn=False, item=True)
    calls = _run(g, ref, first, later, mode == "grad", n_later=_later_calls(case))
    assert all(ok for ok, _ in calls), (calls, _st(g))
    s = cg.stats(g)
    assert s.replays >= 1, _st(g)
    assert any(r for _, r in calls[3:]), f"no replay after the change: {calls} {_st(g)}"
    assert any(k.startswith("piecewise") for k in s.eager_calls), _st(g)


KEYED = {
    "is_conj": (lambda x: x.is_conj(), lambda: torch.randn(4, 8, dtype=torch.cfloat),
                lambda: torch.randn(4, 8, dtype=torch.cfloat).conj()),
    "is_neg": (lambda x: x.is_neg(), lambda: torch.randn(4, 8),
               lambda: torch._neg_view(torch.randn(4, 8))),
    "channels_last": (lambda x: x.is_contiguous(memory_format=torch.channels_last),
                      lambda: torch.randn(2, 3, 4, 8),
                      lambda: torch.randn(2, 3, 4, 8).contiguous(
                          memory_format=torch.channels_last)),
    "dim_order": (lambda x: x.dim_order() == (0, 1), lambda: torch.randn(4, 8),
                  lambda: torch.randn(8, 4).t()),
    "element_size": (lambda x: x.element_size() == 8, lambda: torch.randn(4, 8),
                     lambda: torch.randn(4, 8, dtype=torch.float64)),
}


class KeyedNet(nn.Module):
    def __init__(self, pred):
        super().__init__()
        self.w = nn.Parameter(torch.randn(()))
        self.pred = pred

    def forward(self, x):
        h = x * self.w
        if self.pred(x):
            return h * 2
        return h + 1


@pytest.mark.parametrize("case", list(KEYED))
def test_control_metadata_the_key_holds(sim, case):
    pred, first, later = KEYED[case]
    torch.manual_seed(0)
    ref = KeyedNet(pred)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        reps = []
        for i in range(6):
            torch.manual_seed(i)
            x = (first if i < 3 else later)()
            r0 = cg.stats(g).replays
            a, b = g(x), ref(x)
            assert torch.equal(a, b), (case, i, _st(g))
            reps.append(cg.stats(g).replays - r0)
    assert sum(reps[:3]) >= 1, (reps, _st(g))
    # (a conj or neg view's static copy is one too, since ccf92fa: its capture takes the real
    # call's branch, and it replays; before, the copy was plain and the signature ran eagerly)
    assert sum(reps[3:]) >= 1, (reps, _st(g))


def test_control_is_leaf_refused(sim):
    g, ref = _twins(lambda x: x.is_leaf, fn=False)
    calls = _run(g, ref, _leaf, _nonleaf, grad=False)
    assert all(ok for ok, _ in calls), (calls, _st(g))
    assert any("is_leaf" in k for k in cg.stats(g).eager_calls), _st(g)


class VersionNet(nn.Module):
    """Branches on its own parameter's version counter (whether it was written in place)."""

    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        h = self.inner(x)
        if self.inner.w._version > 0:
            return h * 2
        return h + 1


def test_h9_parameter_version_read_in_python_is_refused(sim):
    torch.manual_seed(0)
    ref = VersionNet()
    g = cg.graphify(copy.deepcopy(ref))
    calls = []
    with torch.no_grad():
        for i in range(5):
            if i == 3:  # an optimizer-like in-place step on both (keeps the graphs, as documented)
                for m in (ref, g):
                    m.inner.w.add_(0.0)
            x = torch.randn(4, 8)
            r0 = cg.stats(g).replays
            a, b = g(x), ref(x)
            calls.append((torch.equal(a, b), cg.stats(g).replays - r0))
    assert all(ok for ok, _ in calls), (calls, _st(g))
    assert _refused(g, "Tensor._version"), _st(g)
    assert any(r for _, r in calls[3:]), f"the piece no longer replays: {calls} {_st(g)}"
