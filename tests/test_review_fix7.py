"""Review of a17907e..313b2d5 (hunt 7's fixes: registries watched again and when OrderedDicts,
a registry referred to from elsewhere left unwatched and its calls eager, views watched as their
dicts, ``.grad`` read in forward refused, a graph per requires_grad pattern where a forward
read ``requires_grad`` under no_grad). CPU, on the simulated backend (``sim``); every scenario
is compared with a plain-PyTorch twin (no cudagraphify) bitwise.

Findings (all fixed: their tests are plain tests now, but for S3's local variable, documented
in the README as a strict xfail):

- S1 silent: a graph made by rebasing a family's template (a static-state argument: a KV
  cache) does not carry the template's ``grads_read``: ``_rebase.family_key`` holds the
  requires_grad pattern only under grad mode and ``Families.entry`` makes a ``CapturedGraph``
  whose ``grads_read`` is None. A forward reading ``requires_grad`` under no_grad, its
  parameter's ``requires_grad_(False)``, a new cache: the template's branch replays.
  ``test_s1_rebased_family_graph_ignores_the_requires_grad_pattern``
- S2 silent (older than these commits, left open beside F5): a forward reading an
  *argument's* ``requires_grad`` under no_grad, called with a tensor that requires grad. The
  key tells the pattern apart, but the capture runs on the static input copy, which does not
  require grad: the graph bakes the other branch and every replay gives it.
  ``test_s2_argument_requires_grad_read_under_no_grad`` (a module, a function)
- S3 silent: ``_statics._kept_elsewhere`` lets every module's ``__dict__`` refer to a registry
  (meant for its owner's only), and every frame: a registry another module shares
  (``copy.copy(module)`` shares its registries) or that a module keeps under another name, or
  a local alias in a running function, is still swapped for a watched copy, and the other
  holder goes on with the old dict. Writes through it (``base.weight = new``: the shallow
  copy's weight too in PyTorch) no longer reach the graphed module: it replays the old
  weight. ``test_s3_registry_referred_to_elsewhere_is_swapped_anyway[...]``
- L1 loud: the first call of a graphified model inside ``for n, p in
  model.named_parameters()`` (or ``parameters()``/``named_buffers()``: a sensitivity or
  perturbation loop) finds ``torch.nn.Module._named_members``'s generator holding a
  ``dict_items`` view of a registry (``members = module._parameters.items()``), takes it for a
  view kept elsewhere, and makes ``StaticState.opaque`` a reason: every call runs eagerly, the
  loop's and every one after it (nothing rescans until a structural write), with a reason
  ("a view of it kept: .keys()...") the code never did. Before: captured, replayed.
  ``test_l1_first_call_inside_a_parameters_loop_runs_eagerly_for_good``
- L2 loud: ``cg.explain(g, x)`` before the first call: explain's run makes the state (the
  scan) while ``_explain.left_as_they_were`` holds ``_writes.contents`` snapshots, tuples
  that refer to every module's registries; ``_kept_elsewhere`` takes cudagraphify's own
  snapshot for a view kept elsewhere: every later call eager, for good. Before: captured,
  replayed (``tests/test_review_r63.py::test_finding_g_explain_before_the_first_call_removes_
  direct_call`` fails at 313b2d5 for this reason).
  ``test_l2_explain_before_the_first_call_runs_every_call_eagerly``

Also (no product bug): ``tests/test_review_last2.py::test_a_kept_tensor_reached_through_a_
getter_then_transposed_matches_eager[grad]`` is a strict xfail that now XPASSes (F3 refuses
the ``.grad`` read): the suite fails there until it is made a plain test.

Controls (plain tests, each proves a replay): the same loop after a first call outside it;
a family rebased with a forward reading ``requires_grad`` and no flip; a parameter's
``requires_grad`` flipped with the read in a piece of a piecewise plan, after
``capture_sizes`` and in a ``graph_region`` (a new capture each, equal to eager); an argument
not requiring grad; a ``dict.values()`` view of a dict of tensors (the replaced tensor seen);
``inspect.signature().parameters``, ``Enum.__members__`` and a class-dict proxy kept as
attributes (still graphed); ``nn.TransformerEncoder`` under no_grad (its ``requires_grad``
reads are under grad mode only: fast path kept); a ``ModuleList`` of graphified layers
iterated by the parent; an ``OrderedDict`` registry from ``ModuleList.__delitem__`` watched.
"""
from __future__ import annotations

import copy
import enum
import inspect
import types

import pytest
import torch
from torch import nn

import cudagraphify as cg

from test_rebase import _generate, _pair, fam  # noqa: F401 (a fixture)
from test_review_static_state import Net
from test_share_engine import reading  # noqa: F401 (a fixture fam uses)

pytestmark = pytest.mark.usefixtures("quiet")

SILENT = pytest.mark.xfail(strict=True, raises=AssertionError)


def _replays(g, at_least=1):
    s = cg.stats(g)
    if s.replays < at_least:
        pytest.fail(f"no replay: {s.captures} captures, {dict(s.eager_calls)}")
    return s


# ============================== S1: rebased families =========================================

class NetReadsGrad(Net):
    """Net (a static-state cache argument) whose forward reads requires_grad under no_grad."""

    def forward(self, x, cache, pos):
        out = super().forward(x, cache, pos)
        return out * (2.0 if self.projs[0].weight.requires_grad else 3.0)


def test_s1_rebased_family_graph_ignores_the_requires_grad_pattern(fam):  # noqa: F811
    ref, g = _pair(NetReadsGrad)
    kept = [_generate(ref, g) for _ in range(4)]
    s = cg.stats(g)
    if s.retargets < 1:
        pytest.fail(f"no family rebased before the change: {s}")
    for m in (ref, g):
        m.projs[0].requires_grad_(False)
    kept += [_generate(ref, g) for _ in range(2)]  # (asserts each step equal to eager's)


def test_control_s1_family_rebased_with_the_read_and_no_flip(fam):  # noqa: F811
    ref, g = _pair(NetReadsGrad)
    kept = [_generate(ref, g) for _ in range(5)]
    s = cg.stats(g)
    assert s.retargets >= 2 and s.replays >= 5, s
    del kept


# ============================== S2: an argument's requires_grad ===============================

class ArgGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return self.l(x) * (2.0 if x.requires_grad else 3.0)


def _arg_fn(x):
    return x * (2.0 if x.requires_grad else 3.0)


@pytest.mark.parametrize("what", ["module", "function"])
def test_s2_argument_requires_grad_read_under_no_grad(sim, what):
    torch.manual_seed(0)
    ref = ArgGrad() if what == "module" else _arg_fn
    g = cg.graphify(copy.deepcopy(ref) if what == "module" else _arg_fn)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(4, 8, requires_grad=True)  # (an embedding made with grad on)
            assert torch.equal(g(x), ref(x)), f"call {i}: {cg.stats(g)}"


def test_control_s2_argument_not_requiring_grad(sim):
    torch.manual_seed(0)
    ref = ArgGrad()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    _replays(g, 3)


# ============================== S3: a registry referred to elsewhere =========================

def _lin():
    torch.manual_seed(0)
    return nn.Linear(8, 8)


class Aliased(nn.Module):
    """Keeps its own ``_modules`` under another name (``self.table``)."""

    def __init__(self):
        super().__init__()
        self.a = _lin()
        self.table = self._modules  # (a plain attribute: the same dict)

    def forward(self, x):
        return self.a(x)


def _shallow():
    base = _lin()
    return base, copy.copy(base)  # (shares base's _parameters, as PyTorch's copy.copy does)


@pytest.mark.parametrize("case", [
    "copy_copy", "attribute_alias",  # (fixed: kept elsewhere, not swapped: its version checked)
    pytest.param("local_alias", marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                 reason="documented (README): a registry held by a local variable of a running "
                        "function is no referrer gc knows; it is swapped for a watching copy"))])
def test_s3_registry_referred_to_elsewhere_is_swapped_anyway(sim, case):
    if case == "copy_copy":
        ref_base, ref = _shallow()
        base, m = _shallow()
        change = [lambda b=b: setattr(b, "weight", nn.Parameter(torch.ones(8, 8)))
                  for b in (ref_base, base)]
    elif case == "attribute_alias":
        ref, m = Aliased(), Aliased()
        torch.manual_seed(1)
        new = nn.Linear(8, 8)
        change = [lambda h=h: h.table.__setitem__("a", copy.deepcopy(new)) for h in (ref, m)]
    else:  # a local alias in the running function, taken before the first call
        ref, m = nn.Sequential(_lin()), nn.Sequential(_lin())
        ref_reg, reg = ref._modules, m._modules  # (this frame's locals only)
        torch.manual_seed(1)
        new = nn.Linear(8, 8)
        change = []
    g = cg.graphify(m)
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                if case == "local_alias":  # (the others run eagerly: checked below)
                    _replays(g)
                for c in change:
                    c()
                if case == "local_alias":
                    ref_reg["0"] = copy.deepcopy(new)
                    reg["0"] = copy.deepcopy(new)
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}: differs from PyTorch's ({case})"
    if case != "local_alias":  # (left in place, its dict version checked: still graphed)
        s = cg.stats(g)
        assert s.replays >= 3 and s.captures == 2 and not s.eager_calls, s


# ============================== L1: first call inside a parameters() loop ====================

def _seq():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


@pytest.mark.parametrize("loop", ["named_parameters", "parameters", "named_buffers"])
def test_l1_first_call_inside_a_parameters_loop_runs_eagerly_for_good(sim, loop):
    ref = _seq()
    if loop == "named_buffers":
        ref[0].register_buffer("b", torch.ones(8))
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in getattr(g, loop)():  # (a perturbation / sensitivity loop)
            assert torch.equal(g(x), ref(x))
        for i in range(4):
            assert torch.equal(g(x), ref(x))
    s = cg.stats(g)
    assert s.captures >= 1 and s.replays >= 3, dict(s.eager_calls)


def test_l2_explain_before_the_first_call_runs_every_call_eagerly(sim):
    ref = _seq()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        cg.explain(g, torch.randn(4, 8))
        for i in range(5):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    s = cg.stats(g)
    assert s.captures >= 1 and s.replays >= 3, dict(s.eager_calls)


def test_control_l2_explain_after_the_first_call(sim):
    ref = _seq()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        g(torch.randn(4, 8))
        cg.explain(g, torch.randn(4, 8))
        for i in range(5):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    s = _replays(g, 3)
    assert not s.eager_calls, dict(s.eager_calls)


def test_control_l1_the_loop_after_a_first_call(sim):
    ref = _seq()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(4, 8)
    with torch.no_grad():
        g(x)
        for _ in g.named_parameters():
            assert torch.equal(g(x), ref(x))
    s = _replays(g, 4)
    assert s.eager == 0, dict(s.eager_calls)


# ============================== controls: requires_grad read in other paths ==================

class ReadsGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) * (2.0 if self.a.weight.requires_grad else 3.0)


class PieceRoot(nn.Module):
    """A piecewise plan (a host sync in the root); the piece reads requires_grad."""

    def __init__(self):
        super().__init__()
        self.p, self.q = ReadsGrad(), nn.Linear(8, 8)

    def forward(self, x):
        y = self.p(x)
        if y.sum().item() > 1e9:
            y = y * 2
        return self.q(y)


def test_control_requires_grad_flipped_read_in_a_piece(sim):
    torch.manual_seed(0)
    ref = PieceRoot()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(8):
            if i == 4:
                before = cg.stats(g).replays
                for m in (ref, g):
                    m.p.a.requires_grad_(False)
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    assert cg.stats(g).replays > before


def test_control_requires_grad_flipped_after_capture_sizes(sim):
    torch.manual_seed(0)
    ref = ReadsGrad()
    g = cg.graphify(copy.deepcopy(ref))
    sizes = [1, 2, 4]
    with torch.no_grad():
        cg.capture_sizes(g, lambda n: torch.randn(n, 8), sizes, progress=False)
        for m in (ref, g):
            m.requires_grad_(False)
        for n in sizes * 2:
            x = torch.randn(n, 8)
            assert torch.equal(g(x), ref(x)), n
    s = _replays(g, 3)
    assert s.captures == 6, s


def test_control_requires_grad_flipped_in_a_graph_region(sim):
    torch.manual_seed(0)
    ref = ReadsGrad()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad(), cg.graph_region():
        for i in range(8):
            if i == 4:
                for m in (ref, g):
                    m.requires_grad_(False)
            x = torch.randn(4, 8)
            assert torch.equal(g(x).clone(), ref(x)), f"call {i}"
    _replays(g, 4)


# ============================== controls: views, common modules, containers ==================

def _f(x, mask=None, scale: float = 1.0):
    return x


class Color(enum.Enum):
    R = 1
    G = 2


class KeptViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.sig = inspect.signature(_f).parameters
        self.members = Color.__members__
        self.cls = types.MappingProxyType(vars(nn.Linear))
        self.d = {"s": torch.ones(8)}
        self.v = self.d.values()

    def forward(self, x):
        out = self.l(x) * (2.0 if "mask" in self.sig else 3.0) * len(self.members)
        out = out * (1.0 if "forward" in self.cls else 5.0)
        for t in self.v:
            out = out * t
        return out


def test_control_views_kept_as_attributes(sim):
    torch.manual_seed(0)
    ref = KeptViews()
    torch.manual_seed(0)
    g = cg.graphify(KeptViews())
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                _replays(g)
                for m in (ref, g):
                    m.d["s"] = torch.full((8,), 2.0)
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    s = _replays(g, 3)
    assert s.eager == 0, dict(s.eager_calls)


def test_control_transformer_encoder_under_no_grad_keeps_the_fast_path(sim):
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0,
                                                           batch_first=True), 2,
                                enable_nested_tensor=False).eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 5, 32)
            torch.testing.assert_close(g(x), ref(x))
    s = _replays(g, 4)
    assert s.eager == 0 and type(g._cudagraphify_state._fast).__name__ == "Fast", s


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_control_graphified_layers_iterated_by_their_parent(sim):
    torch.manual_seed(0)
    ref = Stack()
    g = copy.deepcopy(ref)
    for i, layer in enumerate(g.layers):
        g.layers[i] = cg.graphify(layer)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    assert all(cg.stats(layer).replays >= 3 for layer in g.layers)


def test_control_modulelist_del_then_append_is_seen(sim):
    torch.manual_seed(0)
    ref = Stack()
    g = cg.graphify(copy.deepcopy(ref))
    torch.manual_seed(3)
    extra = nn.Linear(8, 8)
    with torch.no_grad():
        for i in range(8):
            if i == 3:
                _replays(g)
                for m in (ref, g):
                    del m.layers[0]
            if i == 5:
                for m in (ref, g):
                    m.layers.append(copy.deepcopy(extra))
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    _replays(g, 4)
