"""Review hunt 8c (of 3ca76f2: the probe refuses, PYTHON_STATE, a forward's read of
``_probe.COPY_READS`` on a copied argument's memory by code outside torch, and a static's
``_version``): what the fix still lets through, and what it refuses without need. CPU, on the
simulated backend (``sim``); every scenario runs a graphified twin beside an eager one
(``copy.deepcopy`` before ``graphify``), compared bitwise, and ``cg.stats`` proves the replays.

The pattern (as hunt 8's): the first calls pass an argument whose metadata agrees with its
static copy's (a fresh tensor: offset 0, aligned, its own storage, not aliased), the graph is
captured and replays; a later call passes one with the SAME shape, strides, dtype and device
(the same signature) that differs only where the copy does not keep it; eager takes the other
branch, the replay the captured one. No error, no warning, no eager call.

Status since the fix that followed this review: S1, S2, S4, S5, S6 and E1 are refused (more
names in ``_probe.COPY_READS``, ``STATIC_READS`` and ``PINNED_READS``; ``torch/_ops.py`` is
dispatch, not a reader; explain flattens its arguments) and S3's ``x is y`` is another key
(``_signature.repeated``): plain tests now. L1: Triton's files are trusted readers (checked on
the GPU). S8 is fixed since (a leaf's class is in the key, ``_signature.leaf_kind``). Open,
strict xfails (README): S3 for arguments that share memory without being one object, S7, S9.

Findings (strict xfails when found):

Silent, a read the set misses (``_probe.COPY_READS`` lists names; these reach the same metadata
under other names, or past the mode):

- S1 ``x.const_data_ptr()`` (``Tensor.const_data_ptr``: the same address as ``data_ptr``, not
  in the set): ``test_s1_const_data_ptr[module|fn]``; the same under ``capture_sizes``, a
  ``graph_region`` and ``share_graph`` (the fix's paths): ``test_s1_const_data_ptr_other_paths``.
- S2 ``torch.ops.aten.storage_offset(x)`` / ``torch.ops.aten.sym_storage_offset(x)`` (the mode
  sees them as ``torch.storage_offset`` / ``torch.sym_storage_offset``, not
  ``Tensor.storage_offset``): ``test_s2_aten_storage_offset[*]``.
- S3 aliasing between two arguments: ``x is y`` (no hook sees it) and
  ``torch._C._is_alias_of(x, y)`` (a ``torch._C`` function the mode does not see). Each copied
  leaf gets its own static copy, and the signature (``_signature.build_signature`` /
  ``tensor_meta``) does not key which leaves are one tensor or share memory (``inputs_alias``
  is checked only where the forward writes an argument, ``_engine``): ``g(x, y)`` captured,
  ``g(x, x)`` replays the not-aliased branch. ``x.is_set_to(y)`` (``Tensor.is_set_to``, not in
  the set) is the same on a GPU; the CPU double cannot replay an op with a bool output, so it
  is in the GPU script only. ``test_s3_argument_aliasing[*]``.
- S4 ``x.output_nr`` (autograd metadata, as ``grad_fn``; ``Tensor.output_nr`` not in the set):
  a leaf first, then the second output of ``torch.std_mean`` (same signature, requires grad):
  ``test_s4_output_nr[no_grad|grad]``.
- S5 ``kv._version`` of an argument read in place (``cg.mark_static`` or ``static_argnames``):
  neither copied nor a parameter/buffer, so neither ``probe.copied`` nor ``probe.statics``
  holds it (``_first_call.FirstCall.warm_up``: ``copied`` skips ``static_flags``; ``statics``
  is the module's); the caller writes it in place between calls (a KV cache: the address, the
  key, stays), the replay keeps the captured branch: ``test_s5_version_of_a_static_argument``.
  (The fix refuses exactly this read for a buffer: ``STATIC_READS``.)
- S6 a parameter passed as an argument (read in place: ``warm_up`` marks it static, pinned by
  ``data_ptr``), then a view of it with the same address (``p[:]``, grad mode: the same key):
  ``w._is_view()`` / ``w._base is None`` on it are reads of a static's memory, and only
  ``_version`` is refused there: ``test_s6_parameter_argument_then_its_view[*]``.
- S7 a TorchScript helper (``@torch.jit.script``) reading ``x.storage_offset()``: TorchScript
  runs no ``__torch_function__``, so the probe sees no read: ``test_s7_torchscript_read``.
- S8 the class of a copied argument: an ``nn.Parameter`` the module does not own is copied
  into a plain tensor; ``isinstance(x, nn.Parameter)`` (no hook) after plain-tensor calls:
  ``test_s8_parameter_class_of_a_copied_argument``. (The sibling of H7, an attribute.)

- S9 (``_reader_is_torch`` trusts any torch code, also a helper that hands the value back)
  ``torch.autograd.graph._get_sid(x)`` returns ``(x.data_ptr(), x._version)`` read in torch's
  file: ``if _get_sid(x)[1] > 0`` is not refused: ``test_s9_a_torch_helper_returns_the_version``
  (a private helper: shown for the mechanism; no public one found).

Loud / a report:

- E1 ``cg.explain`` fills ``probe.copied`` from the top-level tensor arguments only
  (``_explain.probe_plan``: ``(*args, *kwargs.values())``), where graphify's first call takes
  every flattened leaf (``FirstCall.warm_up``): a read on a tensor in a list argument is
  refused by graphify (the root runs piecewise) and explain reports the root ``graphed``:
  ``test_e1_explain_misses_a_read_on_a_nested_argument``.
- L1 (GPU only: ``.ci/review/hunt8c/a_checks.py``) a Triton kernel launched on an argument:
  Triton's launcher and its specialization (alignment, ``data_ptr() % 16``) read the
  argument's ``data_ptr`` from Triton's files, which ``_probe._reader_is_torch`` does not trust
  (only the innermost frame's file counts: torch's own Triton kernels are attributed to
  Triton too), so the module is refused (PYTHON_STATE) though the pointer only feeds the
  kernel, which a replay runs on the static copy it was specialised and launched for. Not
  reproducible here (the Triton interpreter takes a path of its own that was refused before).

Controls (plain tests, pass):

- the fix's own reads still refused (``data_ptr``, ``storage_offset``), the piece replays:
  ``test_control_direct_reads_refused``; ``data_ptr`` under ``capture_sizes``, a
  ``graph_region``, ``share_graph``: ``test_control_the_fix_on_other_paths``;
- aliasing seen at the first call (``g(x, x)`` first): the copies differ from the call, the
  two-run check refuses it: ``test_control_aliasing_at_the_first_call_is_caught``;
- ``const_data_ptr`` / ``aten.storage_offset`` of a parameter, stays graphed:
  ``test_control_parameter_reads_stay_graphed``;
- a ``_version`` read of a buffer: refused (the fix; S5's sibling):
  ``test_control_buffer_version_refused``;
- common modules as before the change (the same stats with ``Probe.read_metadata`` off):
  LSTM, GRU, TransformerEncoderLayer (train, grad), ``torch.utils.checkpoint``, a full
  backward hook: ``test_control_common_modules_unchanged[*]``.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _probe

pytestmark = pytest.mark.usefixtures("quiet")


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return x * self.w + 0.5


class Net(nn.Module):
    """Elementwise only; ``pred(x, *rest)`` picks a branch in the root."""

    def __init__(self, pred):
        super().__init__()
        self.inner = Inner()
        self.pred = pred

    def forward(self, x, *rest):
        h = self.inner(x)
        if self.pred(x, *rest):
            return h * 2
        return h + 1


def _st(g) -> str:
    s = cg.stats(g)
    return f"captures={s.captures} replays={s.replays} eager={dict(s.eager_calls)}"


def _twins(pred, fn=False):
    torch.manual_seed(0)
    ref = Net(pred)
    net = copy.deepcopy(ref)
    if fn:
        def forward(*a):
            return net(*a)
        return cg.graphify(forward), ref
    return cg.graphify(net), ref


def _run(g, ref, first, later, grad=False, n_first=3, n_later=2):
    """Per call: (equal to eager bitwise, replays it made)."""
    ctx = torch.enable_grad if grad else torch.no_grad
    out = []
    with ctx():
        for i in range(n_first + n_later):
            torch.manual_seed(i)
            args = (first if i < n_first else later)()
            r0 = cg.stats(g).replays
            a, b = g(*args), ref(*args)
            out.append((torch.equal(a.detach(), b.detach()), cg.stats(g).replays - r0))
    return out


def _silent(g, calls):
    """The finding's assertion: replays before the change, then eager's result after it."""
    assert all(ok for ok, _ in calls[:3]) and cg.stats(g).replays >= 1, (calls, _st(g))
    assert all(ok for ok, _ in calls[3:]), (
        f"silent: the same signature replayed the captured branch: {calls} {_st(g)}")


def _fixed(g, calls):
    """Since the fix: every call eager's result, and the read refused with its reason (or,
    for arguments passed twice, another signature of the key)."""
    assert all(ok for ok, _ in calls), (calls, _st(g))
    s = cg.stats(g)
    assert any("[PYTHON_STATE]" in k or "control flow" in k for k in s.eager_calls) \
        or s.captures >= 2, _st(g)


def _fresh():
    return (torch.randn(4, 8),)


def _misaligned():  # (offset 1 float: data_ptr % 16 == 4)
    return (torch.randn(41)[1:33].view(4, 8),)


def _offset():
    return (torch.randn(40)[8:].view(4, 8),)


SILENT = pytest.mark.xfail(strict=True, raises=AssertionError,
                           reason="silent: a read of what the static copy does not keep, past "
                                  "_probe.COPY_READS / Probe.read_metadata")


# ============================== S1 const_data_ptr ===========================================

@pytest.mark.parametrize("kind", ["module", "fn"])
def test_s1_const_data_ptr(sim, kind):
    g, ref = _twins(lambda x: x.const_data_ptr() % 16 != 0, kind == "fn")
    _fixed(g, _run(g, ref, _fresh, _misaligned))


class SNet(nn.Module):
    def __init__(self, pred):
        super().__init__()
        self.inner = Inner()
        self.pred = pred

    def forward(self, x):
        h = self.inner(x)
        return h * 2 if self.pred(x) else h + 1


def _paths_run(how, pred):
    """(per call: equal to eager, stats of the first graphified) on ``how``'s path: fresh
    arguments, then misaligned ones (same signature)."""
    torch.manual_seed(0)
    if how == "share_graph":
        refs = nn.ModuleList([SNet(pred) for _ in range(3)])
        gs = copy.deepcopy(refs)
        cg.share_graph(gs)
    else:
        refs = [SNet(pred)]
        gs = [cg.graphify(copy.deepcopy(refs[0]))]
    res = []
    with torch.no_grad():
        if how == "capture_sizes":
            cg.capture_sizes(gs[0], lambda n: torch.randn(n, 8), [8, 4], progress=False)
        region = cg.graph_region() if how == "graph_region" else contextlib.nullcontext()
        with region:
            for i in range(5):
                x = torch.randn(4, 8) if i < 3 else _misaligned()[0]
                for gm, rm in zip(gs, refs):
                    res.append(torch.equal(gm(x), rm(x)))
    return res, gs[0]


PATHS = ["capture_sizes", "graph_region", "share_graph"]


@pytest.mark.parametrize("how", PATHS)
def test_s1_const_data_ptr_other_paths(sim, how):
    res, g = _paths_run(how, lambda x: x.const_data_ptr() % 16 != 0)
    assert all(res), f"{res} {_st(g)}"
    assert cg.stats(g).replays >= 1 and "Tensor.const_data_ptr [PYTHON_STATE]" in _st(g), _st(g)


# ============================== S2 aten storage_offset ======================================

ATEN = {"storage_offset": lambda x: torch.ops.aten.storage_offset(x) > 0,
        "sym_storage_offset": lambda x: torch.ops.aten.sym_storage_offset.default(x) > 0}


@pytest.mark.parametrize("kind", ["module", "fn"])
@pytest.mark.parametrize("op", list(ATEN))
def test_s2_aten_storage_offset(sim, op, kind):
    g, ref = _twins(ATEN[op], kind == "fn")
    _fixed(g, _run(g, ref, _fresh, _offset))


# ============================== S3 aliasing between arguments ===============================

def _two():
    return torch.randn(4, 8), torch.randn(4, 8)


def _same():
    t = torch.randn(4, 8)
    return t, t


def _view_of_one():
    t = torch.randn(4, 8)
    return t, t[:]


ALIAS = {"is": (lambda x, y: x is y, _same),
         "_is_alias_of": (lambda x, y: torch._C._is_alias_of(x, y), _view_of_one)}


@pytest.mark.parametrize("kind", ["module", "fn"])
def test_s3_an_argument_passed_twice_is_another_key(sim, kind):
    # (fixed: which tensor leaves are the same object is in the key, _signature.repeated)
    pred, later = ALIAS["is"]
    g, ref = _twins(pred, kind == "fn")
    _fixed(g, _run(g, ref, _two, later))


@SILENT
@pytest.mark.parametrize("kind", ["module", "fn"])
def test_s3_arguments_sharing_memory(sim, kind):
    # (open: arguments that are views of one memory, not the same object, key alike)
    pred, later = ALIAS["_is_alias_of"]
    g, ref = _twins(pred, kind == "fn")
    _silent(g, _run(g, ref, _two, later))


# ============================== S4 output_nr ================================================

def _leaf():
    return (torch.randn(4, 8).requires_grad_(),)


def _second_output():
    with torch.enable_grad():
        return (torch.std_mean(torch.randn(3, 4, 8, requires_grad=True), dim=0)[1],)


@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_s4_output_nr(sim, mode):
    g, ref = _twins(lambda x: x.output_nr == 0)
    _fixed(g, _run(g, ref, _leaf, _second_output, grad=mode == "grad"))


# ============================== S5 _version of a static argument ============================

class KV(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x, kv):
        h = self.inner(x)
        if kv._version > 0:  # ("written since it was made": a cache filled in place)
            return h * 2 + kv
        return h + 1


@pytest.mark.parametrize("how", ["mark_static", "static_argnames"])
def test_s5_version_of_a_static_argument(sim, how):
    torch.manual_seed(0)
    ref = KV()
    net = copy.deepcopy(ref)
    g = cg.graphify(net, static_argnames="kv") if how == "static_argnames" else cg.graphify(net)
    kv_g, kv_r = torch.zeros(4, 8), torch.zeros(4, 8)
    if how == "mark_static":
        cg.mark_static(kv_g)
    calls = []
    with torch.no_grad():
        for i in range(5):
            if i == 3:  # the caller writes its cache in place (same address: same key)
                kv_g.add_(1.0)
                kv_r.add_(1.0)
            x = torch.randn(4, 8)
            r0 = cg.stats(g).replays
            a, b = g(x, kv=kv_g), ref(x, kv=kv_r)
            calls.append((torch.equal(a, b), cg.stats(g).replays - r0))
    _fixed(g, calls)


# ============================== S6 a parameter argument, then its view ======================

class PArg(nn.Module):
    def __init__(self, pred):
        super().__init__()
        self.inner = Inner()
        self.p = nn.Parameter(torch.randn(4, 8))
        self.pred = pred

    def forward(self, x, w):
        h = self.inner(x) * w
        if self.pred(w):
            return h * 2
        return h + 1


VIEWNESS = {"_is_view": lambda w: w._is_view(), "_base": lambda w: w._base is None}


@pytest.mark.parametrize("case", list(VIEWNESS))
def test_s6_parameter_argument_then_its_view(sim, case):
    torch.manual_seed(0)
    ref = PArg(VIEWNESS[case])
    net = copy.deepcopy(ref)
    g = cg.graphify(net)
    calls = []
    for i in range(5):  # (grad mode: p[:] requires grad as p does, the same key)
        x = torch.randn(4, 8)
        wg, wr = (net.p, ref.p) if i < 3 else (net.p[:], ref.p[:])
        r0 = cg.stats(g).replays
        a, b = g(x, wg), ref(x, wr)
        a.sum().backward()
        b.sum().backward()
        calls.append((torch.equal(a.detach(), b.detach()), cg.stats(g).replays - r0))
    _fixed(g, calls)


# ============================== S7 TorchScript ==============================================

@torch.jit.script
def _scripted_offset(x: torch.Tensor) -> bool:
    return x.storage_offset() > 0


@SILENT
def test_s7_torchscript_read(sim):
    g, ref = _twins(lambda x: bool(_scripted_offset(x)))
    _silent(g, _run(g, ref, _fresh, _offset))


# ============================== S8 the class of a copied argument ===========================

def test_s8_parameter_class_of_a_copied_argument(sim):
    # (fixed: a leaf's class is in the key, _signature.leaf_kind: the Parameter calls are
    # another signature, whose capture on a plain copy takes the other branch: caught)
    g, ref = _twins(lambda x: isinstance(x, nn.Parameter))
    calls = _run(g, ref, _fresh, lambda: (nn.Parameter(torch.randn(4, 8), requires_grad=False),))
    _silent(g, calls)
    _fixed(g, calls)


# ============================== S9 a torch helper reads for the user =======================

@SILENT
def test_s9_a_torch_helper_returns_the_version(sim):
    # (torch.autograd.graph._get_sid: (data_ptr, _version), read in torch's file, so
    # _reader_is_torch lets it through; private, but the exemption trusts any torch code that
    # hands the value back)
    from torch.autograd.graph import _get_sid
    g, ref = _twins(lambda x: _get_sid(x)[1] > 0)
    _silent(g, _run(g, ref, lambda: (torch.randn(4, 8).add_(1),), _fresh))


# ============================== E1 explain: a nested argument ===============================

class NestedRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x, ys):
        h = self.inner(x)
        return h * 2 if ys[0].storage_offset() > 0 else h + 1


def test_e1_explain_refuses_a_read_on_a_nested_argument(sim):
    torch.manual_seed(0)
    model = NestedRead()
    g = cg.graphify(copy.deepcopy(model))
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(4, 8), [torch.randn(4, 8)])
    # graphify: the root runs piecewise for the read (the fix)
    assert any("Tensor.storage_offset [PYTHON_STATE]" in k for k in cg.stats(g).eager_calls), \
        _st(g)
    data = cg.explain(model, torch.randn(4, 8), [torch.randn(4, 8)]).to_dict()
    statuses = {m["path"]: m["status"] for m in data["modules"]}
    assert statuses[""] == "eager", f"explain: {statuses}; graphify: {_st(g)}"


# ============================== controls =====================================================

@pytest.mark.parametrize("kind", ["module", "fn"])
@pytest.mark.parametrize("case", ["data_ptr", "storage_offset"])
def test_control_direct_reads_refused(sim, case, kind):
    pred, later, op = {
        "data_ptr": (lambda x: x.data_ptr() % 16 != 0, _misaligned, "Tensor.data_ptr"),
        "storage_offset": (lambda x: x.storage_offset() > 0, _offset, "Tensor.storage_offset"),
    }[case]
    g, ref = _twins(pred, kind == "fn")
    calls = _run(g, ref, _fresh, later)
    assert all(ok for ok, _ in calls), (calls, _st(g))
    assert any(f"{op} [PYTHON_STATE]" in k for k in cg.stats(g).eager_calls), _st(g)
    if kind == "module":
        assert any(r for _, r in calls[3:]), (calls, _st(g))


@pytest.mark.parametrize("case", list(ALIAS))
def test_control_aliasing_at_the_first_call_is_caught(sim, case):
    pred, same = ALIAS[case]
    g, ref = _twins(pred)
    calls = _run(g, ref, same, _two)
    assert all(ok for ok, _ in calls), (calls, _st(g))
    if case == "is":  # (since the fix: one copy for the tensor passed twice, a graph of each key)
        assert cg.stats(g).captures == 2 and cg.stats(g).eager_calls == {}, _st(g)
        assert all(r for _, r in calls[1:3] + calls[4:]), (calls, _st(g))
    else:  # (a view of one memory: two copies, the two-run check sees the other path)
        assert any("control flow" in k for k in cg.stats(g).eager_calls), _st(g)
    assert any(r for _, r in calls), (calls, _st(g))  # (the piece replays)


@pytest.mark.parametrize("how", PATHS)
def test_control_the_fix_on_other_paths(sim, how):
    res, g = _paths_run(how, lambda x: x.data_ptr() % 16 != 0)
    assert all(res), (res, _st(g))
    assert any("Tensor.data_ptr [PYTHON_STATE]" in k for k in cg.stats(g).eager_calls), _st(g)
    assert cg.stats(g).replays >= 1, _st(g)


PARAM_READS = {"const_data_ptr": lambda m: m.inner.w.const_data_ptr() % 16 == 0,
               "aten_storage_offset": lambda m: torch.ops.aten.storage_offset(m.inner.w) == 0}


@pytest.mark.parametrize("case", list(PARAM_READS))
def test_control_parameter_reads_stay_graphed(sim, case):
    torch.manual_seed(0)
    ref = Net(lambda x: True)
    ref.pred = lambda x, m=ref: PARAM_READS[case](m)
    net = copy.deepcopy(ref)
    net.pred = lambda x, m=net: PARAM_READS[case](m)
    g = cg.graphify(net)
    calls = _run(g, ref, _fresh, _fresh)
    s = cg.stats(g)
    assert all(ok for ok, _ in calls) and s.replays == 4 and not s.eager_calls, (calls, _st(g))


class BufVersion(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.register_buffer("kv", torch.zeros(4, 8))

    def forward(self, x):
        h = self.inner(x)
        if self.kv._version > 0:
            return h * 2 + self.kv
        return h + 1


def test_control_buffer_version_refused(sim):
    torch.manual_seed(0)
    base = BufVersion()  # (both copies: a deepcopy moves its tensors' versions)
    ref, g = copy.deepcopy(base), cg.graphify(copy.deepcopy(base))
    calls = []
    with torch.no_grad():
        for i in range(5):
            if i == 3:
                ref.kv.add_(1.0)
                g.kv.add_(1.0)
            x = torch.randn(4, 8)
            r0 = cg.stats(g).replays
            a, b = g(x), ref(x)
            calls.append((torch.equal(a, b), cg.stats(g).replays - r0))
    assert all(ok for ok, _ in calls), (calls, _st(g))
    assert any("Tensor._version [PYTHON_STATE]" in k for k in cg.stats(g).eager_calls), _st(g)
    assert any(r for _, r in calls[3:]), (calls, _st(g))


class Ckpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.b(checkpoint(lambda t: self.a(t).relu(), x, use_reentrant=False))


def _hooked():
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    m.register_full_backward_hook(lambda mod, gi, go: None)
    return m


def _first(o):
    return o[0] if isinstance(o, tuple) else o


COMMON = {
    "lstm": (lambda: nn.LSTM(8, 8, batch_first=True), lambda: torch.randn(2, 5, 8), False),
    "gru": (lambda: nn.GRU(8, 8, batch_first=True), lambda: torch.randn(2, 5, 8), False),
    "encoder_layer_train": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        lambda: torch.randn(2, 5, 8), True),
    "checkpoint": (Ckpt, lambda: torch.randn(4, 8, requires_grad=True), True),
    "full_backward_hook": (_hooked, lambda: torch.randn(4, 8, requires_grad=True), True),
}


def _common_stats(case):
    make, inp, grad = COMMON[case]
    torch.manual_seed(0)
    ref = make()
    g = cg.graphify(copy.deepcopy(ref))
    ok = True
    ctx = torch.enable_grad if grad else torch.no_grad
    for i in range(4):
        torch.manual_seed(10 + i)
        x = inp()
        with ctx():
            a, b = _first(g(x)), _first(ref(x))
            if grad:
                a.sum().backward()
                b.sum().backward()
        ok = ok and torch.equal(a.detach(), b.detach())
    s = cg.stats(g)
    return ok, s.captures, s.replays, dict(s.eager_calls)


@pytest.mark.parametrize("case", list(COMMON))
def test_control_common_modules_unchanged(sim, case, monkeypatch):
    now = _common_stats(case)
    monkeypatch.setattr(_probe.Probe, "read_metadata", lambda self, name, args: None)
    before = _common_stats(case)
    assert now == before, (now, before)
    assert now[0] and now[2] >= 3 and not now[3], now
