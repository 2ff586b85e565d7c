"""Review of 14fd1a7, 8ca0d6d, b9656bc (runs that are not calls: the capture copies only host
tensors on CUDA; ``_writes.kept``; ``Capturing._put_back``; a rehearsal's recorder; explain puts
back registries), on the simulated backend.

Tests named ``test_finding_*`` failed on the code reviewed (one group per finding, A-H); all
were fixed after the review (G: explain refuses a lazy module with a usage error). The others
are controls. Every comparison is with eager PyTorch on a ``copy.deepcopy`` twin of the module,
outputs and state. Findings that need a GPU (the CUDA capture copies device tensors no more):
``.ci/review/r62/``.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

import cudagraphify as cg
from cudagraphify._errors import CudagraphifyError
from conftest import SimBackend  # noqa: F401 (the fixtures' backend)
from test_engine import _trusting, faithful  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("quiet")


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# -- F-A (crash, introduced by 8ca0d6d): kept() restores every dict it saw with clear()/update() --


class KeepsOutput(nn.Module):
    """A wrapper that keeps its inner model's last output (an HF ``ModelOutput``, or any dict
    subclass that refuses ``update``/``clear``) for an auxiliary loss or logging."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind
        self.last = None

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "model_output":
            from transformers.modeling_outputs import BaseModelOutput
            self.last = BaseModelOutput(last_hidden_state=h)
        else:
            from torch.fx.immutable_collections import immutable_dict
            self.last = immutable_dict(h=h)
        return h * 2


@pytest.mark.parametrize("kind", ["model_output", "immutable_dict"])
@pytest.mark.parametrize("warmups", [1, 2])
def test_finding_a_dict_subclass_bound_by_the_real_call_crashes_the_first_call(sim, kind,
                                                                                 warmups):
    """``Capturing._left()`` holds the ModelOutput the real call bound to ``self.last``;
    ``_writes.kept`` (_writes.py:147-156) puts every dict it saw back with ``obj.clear();
    obj.update(items)``, unconditionally, on every exit (the capture's window, the extra
    warm-ups'): a ``ModelOutput`` refuses ``update`` (after ``clear`` emptied it), an
    ``immutable_dict`` refuses ``clear``; the exception leaves the user's first call. Eager
    (and the code before 8ca0d6d) returns."""
    if kind == "model_output":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = KeepsOutput(kind)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert close(g.last["last_hidden_state" if kind == "model_output" else "h"],
                         ref.last["last_hidden_state" if kind == "model_output" else "h"]), i


# -- F-B (wrong values, older): a capture refused for its output plan keeps its Python effects --


class Out:
    """An output type not registered with pytree (a plain result object)."""

    def __init__(self, y):
        self.y = y


class ReturnsObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.n = 0
        self.st = {"k": 0}

    def forward(self, x):
        self.n += 1
        self.st["k"] += 1
        return Out(self.lin(x) * self.n)


@pytest.mark.parametrize("warmups", [1, 3])
def test_finding_b_output_plan_refusal_keeps_the_captures_attribute_writes(sim, warmups):
    """``plan_outputs`` raises ``OutputPlanError`` (an output object pytree cannot see) after
    the capture's run: ``Capturing._capture`` (_capturing.py:98-99) returns eagerly without
    ``self._put_back(rec)``, which its other refusal paths call. The capture's ``self.n += 1``
    and ``st["k"] += 1`` stay; as the decision is made again on every call (``n`` is read and
    changes), every call counts twice, and the outputs follow from the second call on."""
    torch.manual_seed(0)
    ref = ReturnsObject()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x).y, ref(x).y), i
            assert (g.n, g.st) == (ref.n, ref.st), (i, g.n, ref.n, g.st, ref.st)


# -- F-C (crash, d5ecd23 / 8ca0d6d): a rehearsal's copies out of memory escape the first call ----


class AsksWithHeld(nn.Module):
    """Trusted capture-aware code (a host sync on its eager path only) that counts its calls
    in a tensor kept as a plain attribute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hits = torch.zeros(100)

    def forward(self, x):
        self.hits.add_(1)
        if not torch.cuda.is_current_stream_capturing():
            bool((x > -1e9).all())  # a host sync
        return self.lin(x) + self.hits[:4]


def test_finding_c_rehearsal_copy_out_of_memory_escapes_the_first_call(faithful, monkeypatch):
    """``rehearse`` (_rehearsal.py:48-49) enters ``_writes.kept(first._left(), held)``, which
    copies the held tensors (and now every tensor the real call bound to an attribute), outside
    any try: where that copy does not fit (a large plain-attribute table or cache on a full
    GPU; simulated by the copy raising torch.OutOfMemoryError), the error leaves the user's
    first call, though the real call ran and wrote ``hits``. ``Capturing.capture`` defers on
    the same error (r60's B); a rehearsal should give up (no rehearsal: the warm-up's plan)."""
    torch.manual_seed(0)
    ref = AsksWithHeld()
    g = cg.graphify(copy.deepcopy(ref), op_policy=_trusting(__name__))
    orig = torch.Tensor.clone

    def clone(self, *args, **kwargs):
        f = sys._getframe(1)
        if f.f_code.co_filename.endswith("_writes.py") and f.f_code.co_name == "undone":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: the held copy)")
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", clone)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.hits, ref.hits), i


# -- F-D (wrong values, introduced by 7203dea): explain puts back a flag, not the hook it set ----


class TapsOnce(nn.Module):
    """Registers a forward hook on a submodule on its first call, noting it in a flag."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.tapped = False

    def forward(self, x):
        if not self.tapped:
            self.lin.register_forward_hook(lambda m, a, o: o * 2)
            self.tapped = True
        return self.head(self.lin(x))


@pytest.mark.parametrize("graphed", [False, True])
def test_finding_d_explain_puts_back_the_flag_but_not_the_hook(sim, graphed):
    """``left_as_they_were`` (_explain.py:177-183) puts ``tapped`` back to False (7203dea), but
    the hook explain's first run registered stays: ``lin._forward_hooks`` is changed in place,
    the same OrderedDict, so neither the ``__dict__`` nor the registries' restore sees it. The
    first real call registers the hook again: ``lin``'s output is doubled twice. Before
    7203dea both stayed, consistently, and the calls were right."""
    torch.manual_seed(0)
    ref = TapsOnce()
    m = copy.deepcopy(ref)
    cg.explain(m, torch.randn(2, 4))
    g = cg.graphify(m) if graphed else m
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
    assert len(m.lin._forward_hooks) == len(ref.lin._forward_hooks)


# -- F-E (crash, introduced by 8ca0d6d): explain puts back registries, not the class ------------


class Sym(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


class ParametrizesOnFirstUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if not parametrize.is_parametrized(self.lin):
            parametrize.register_parametrization(self.lin, "weight", Sym())
        return self.lin(x)


def test_finding_e_explain_restores_registries_of_a_parametrized_class(sim):
    """``register_parametrization`` moves ``weight`` into ``lin.parametrizations`` and swaps
    ``lin``'s class for a ``ParametrizedLinear`` whose ``weight`` is a property. explain's
    registries restore (8ca0d6d, _explain.py:172-176) puts ``_parameters`` and ``_modules``
    back, the class stays: ``lin.weight`` reads ``self.parametrizations``, which is gone, and
    every later call raises (KeyError). Before 8ca0d6d the module stayed parametrized and
    worked."""
    torch.manual_seed(0)
    ref = ParametrizesOnFirstUse()
    m = copy.deepcopy(ref)
    cg.explain(m, torch.randn(2, 4))
    with torch.no_grad():
        for i in range(2):
            x = torch.randn(2, 4)
            assert close(m(x), ref(x)), i


# -- F-F (wrong values, older): explain's run consumes a one-shot hook --------------------------


class ActNorm(nn.Module):
    """Data-dependent initialisation (Glow's ActNorm) by a pre-hook that removes itself: the
    scale, a buffer, is set from the first batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self._init_hook = self.register_forward_pre_hook(ActNorm._init)

    @staticmethod
    def _init(mod, args):
        with torch.no_grad():
            mod.scale.copy_(1 / mod.lin(args[0]).std(0))
        mod._init_hook.remove()

    def forward(self, x):
        return self.lin(x) * self.scale


def test_finding_f_explain_consumes_a_one_shot_hook(sim):
    """explain's first run initialises ``scale`` and the hook removes itself; ``restored``
    puts the buffer back (ones), nothing puts the hook back (``_forward_pre_hooks`` changed
    in place): the module is never initialised, with no warning (no parameter was written)."""
    torch.manual_seed(0)
    ref = ActNorm()
    m = copy.deepcopy(ref)
    cg.explain(m, torch.randn(8, 4) * 5)
    with torch.no_grad():
        for i in range(2):
            x = torch.randn(8, 4)
            assert close(m(x), ref(x)), i
            assert torch.equal(m.scale, ref.scale), i


# -- F-G (crash, older): explain on an uninitialised lazy module ----------------------------------


class LazyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.LazyLinear(4)

    def forward(self, x):
        return self.lin(x)


def test_finding_g_explain_on_a_lazy_module_raises(sim):
    """``left_as_they_were`` (_explain.py:159-160) calls ``p.is_inference()`` on every
    parameter: an ``UninitializedParameter`` raises ValueError (before 7203dea the probe's
    ``a.shape`` raised instead). explain should name the module as not yet initialised (or
    skip lazy parameters), and must not initialise it with its own random draws."""
    torch.manual_seed(0)
    ref = LazyNet()
    m = copy.deepcopy(ref)
    x = torch.randn(2, 6)
    try:
        cg.explain(m, x)
    except CudagraphifyError:  # (a clear refusal, naming the lazy module, would do too)
        pass
    torch.manual_seed(1)
    a = m(x)
    torch.manual_seed(1)
    b = ref(x)
    assert torch.equal(a, b)


# -- F-H (wrong values, older): a chaining region replays a graph that writes a bound tensor ----


class LazyCounter(nn.Module):
    """Binds a counter tensor on its first call (no op: taken from a pool), then counts in
    place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = None
        self.pool = [torch.zeros(8)]

    def forward(self, x):
        if self.acc is None:
            self.acc = self.pool.pop()
        self.acc[:4].add_(1)
        return self.lin(x) + self.acc[:4]


def test_finding_h_region_chain_replays_a_write_to_a_tensor_the_real_call_bound(sim):
    """``verify`` lets a chaining region's first call replay its graph unless
    ``_wrote_held()`` (_first_call.py:392-393); ``held_tensors()`` is the warm-up guard's
    tensors, i.e. what the real call read *first* (``acc`` was None), so the tensor it bound
    and wrote is missed (with ``probe=False`` nothing else refuses it; with the probe it is
    an outside tensor and the root runs piecewise). The replay adds 1 once more: ``acc`` is
    one ahead of eager from the first call on. ``held_storages`` (the argument aliasing
    check) misses it likewise; ``_left()`` holds exactly these tensors."""
    torch.manual_seed(0)
    ref = LazyCounter()
    g = cg.graphify(copy.deepcopy(ref), probe=False)
    with torch.no_grad():
        for i in range(3):
            with cg.graph_region():
                x = torch.randn(2, 4)
                assert close(g(x), ref(x)), i
                assert torch.equal(g.acc, ref.acc), (i, g.acc[:4], ref.acc[:4])


# -- controls ------------------------------------------------------------------------------------


class KeepsPlain(nn.Module):
    """Keeps its last output in a plain dict, an OrderedDict and an object, rebound each call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        import collections
        import types
        h = self.lin(x)
        self.d = {"h": h}
        self.od = collections.OrderedDict(h=h)
        self.ns = types.SimpleNamespace(h=h, log=[h.sum()])
        return h * 2


@pytest.mark.parametrize("warmups", [1, 3])
def test_plain_containers_bound_by_the_real_call_control(sim, warmups):
    torch.manual_seed(0)
    ref = KeepsPlain()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert close(g.d["h"], ref.d["h"]) and close(g.od["h"], ref.od["h"]), i
            assert close(g.ns.h, ref.ns.h) and len(g.ns.log) == 1, i


def test_graphify_lazy_module_control(sim):
    torch.manual_seed(0)
    ref = LazyNet()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=2)
    x = torch.randn(2, 6)
    torch.manual_seed(1)
    a = g(x)
    torch.manual_seed(1)
    b = ref(x)
    assert torch.equal(a, b)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 6)
            assert torch.equal(g(x), ref(x)), i


class Parametrized(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        parametrize.register_parametrization(self.lin, "weight", Sym())

    def forward(self, x):
        return self.lin(x)


def test_parametrized_module_explain_and_training_control(sim):
    torch.manual_seed(0)
    ref = Parametrized()
    g = copy.deepcopy(ref)
    cg.explain(g, torch.randn(2, 4))
    cg.graphify(g, num_warmup_iters=2)
    for i in range(3):
        x = torch.randn(2, 4)
        a, b = g(x), ref(x)
        assert close(a, b), i
        a.sum().backward()
        b.sum().backward()
        assert close(g.lin.parametrizations.weight.original.grad,
                     ref.lin.parametrizations.weight.original.grad), i


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.lin.register_forward_hook(lambda m, a, o: o * 2)
        self.n = 0

    def forward(self, x):
        self.n += 1
        return self.head(self.lin(x))


def test_explain_module_with_a_persistent_hook_control(sim):
    torch.manual_seed(0)
    ref = Hooked()
    g = copy.deepcopy(ref)
    cg.explain(g, torch.randn(2, 4))
    cg.graphify(g)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert g.n == ref.n, i


class Transposer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        if kind == "requires_grad":
            self.m = torch.randn(10, 10, requires_grad=True)
        elif kind == "view":
            self.m = torch.randn(20, 20)[:10, 5:15]
        else:
            self.m = torch.randn(10, 10)

    def forward(self, x):
        self.m.t_()
        return self.lin(x).repeat(1, 3)[:, :10] @ self.m


@pytest.mark.parametrize("kind", ["plain", "requires_grad", "view"])
@pytest.mark.parametrize("warmups", [1, 3])
def test_held_layout_restore_variants_control(sim, kind, warmups):
    torch.manual_seed(0)
    ref = Transposer(kind)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.m, ref.m), i


class Ring(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ring = torch.zeros(8)

    def forward(self, x):
        self.ring[0] += 1
        self.ring = torch.roll(self.ring, 1)
        return self.lin(x) * self.ring[:4]


class RingRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Ring()
        self.b = Ring()
        self.n = 0

    def forward(self, x):
        self.n += 1
        return self.b(self.a(x))


@pytest.mark.parametrize("warmups", [1, 3])
def test_training_ring_bound_by_the_real_call_control(sim, warmups):
    """(On the CPU double all bound tensors are copied and their versions kept; on CUDA the
    capture's own in-place write moves the version: .ci/review/r62/b_*.)"""
    torch.manual_seed(0)
    ref = Ring()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    for i in range(4):
        x = torch.randn(2, 4)
        a, b = g(x), ref(x)
        assert close(a, b), i
        a.sum().backward()
        b.sum().backward()
        assert close(g.lin.weight.grad, ref.lin.weight.grad), i
        assert torch.equal(g.ring, ref.ring), i


@pytest.mark.parametrize("region", [False, True])
@pytest.mark.parametrize("warmups", [1, 3])
def test_piecewise_ring_pieces_control(sim, region, warmups):
    torch.manual_seed(0)
    ref = RingRoot()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(5):
            with (cg.graph_region() if region else contextlib.nullcontext()):
                x = torch.randn(2, 4)
                assert close(g(x), ref(x)), i
                assert torch.equal(g.a.ring, ref.a.ring) and torch.equal(g.b.ring, ref.b.ring)
                assert g.n == ref.n, i


def test_share_graph_ring_layers_control(sim):
    torch.manual_seed(0)
    refs = nn.ModuleList([Ring() for _ in range(3)])
    layers = copy.deepcopy(refs)
    cg.share_graph(layers, num_warmup_iters=2)
    with torch.no_grad():
        for i in range(4):
            x = y = torch.randn(2, 4)
            for layer, r in zip(layers, refs):
                x, y = layer(x), r(y)
            assert close(x, y), i
            assert all(torch.equal(a.ring, b.ring) for a, b in zip(layers, refs)), i
