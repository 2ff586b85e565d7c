"""Review of 27cfff6 (``read_tensors``/``_bound_tensors``: held_storages from the tensors read
in place only, bound tensors written "before made" only; order-aware ``refill``; the guard's
OrderedDict order, dict-subclass ``__dict__`` and slots-dataclass checks; explain's ``_ours``,
refill by name and ``_lazy_refused``; lazy modules watched by forward pre-hooks; hooks of
modules a call did not run). Run on the simulated backend.

Tests named ``test_finding_*`` failed on the reviewed code (one group per finding, A-F); all
pass now (B, C: the lazy-module watching was withdrawn, calls run eagerly while a lazy
parameter is uninitialized, as before). The others are controls. Every comparison is with eager PyTorch on a ``copy.deepcopy``
twin of the module (outputs and state); speed findings assert the counters. GPU script:
``.ci/review/r64/b_lazy_head_in_capture.py`` (B on a GPU: a lazy head first reached inside a
CUDA capture, not run).
"""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.parameter import is_lazy

import cudagraphify as cg
from conftest import SimBackend  # noqa: F401 (the fixtures' backend)

pytestmark = pytest.mark.usefixtures("quiet")


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def same_params(g, ref):
    for (n, p), q in zip(g.named_parameters(), ref.parameters()):
        assert is_lazy(p) == is_lazy(q), n
        if not is_lazy(p):
            assert close(p, q), n


# -- F-A (wrong values, introduced by 27cfff6 (A)): an argument aliasing a bound tensor ---------


class KeepsAccumulator(nn.Module):
    """Keeps the accumulator it is passed the first time and adds to it in place; reads the
    argument after the write (a running-sum buffer the caller owns and passes every call)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = None

    def forward(self, x, buf):
        if self.acc is None:
            self.acc = buf
        self.acc.add_(x)
        return self.lin(buf)


def test_finding_a_argument_aliasing_a_bound_tensor_the_graph_writes(sim):
    """``entry.held_storages`` now comes from ``read_tensors()`` only (_first_call.py:403): the
    warm-up read ``self.acc`` as None, so the tensor the real call bound there (the argument
    ``buf``) is in no entry's held set. The graph (captured with ``acc`` bound) writes that
    storage in place and reads ``buf`` from its copy, made before the write: the next call
    that passes the same ``buf`` replays (no HELD_ALIAS check fires, _engine.py:495) and
    returns ``lin(buf)`` of the value before ``add_``. Before 27cfff6 the bound tensors were
    in held_storages and that call ran eagerly."""
    torch.manual_seed(0)
    ref = KeepsAccumulator()
    g = cg.graphify(copy.deepcopy(ref))
    bg, br = torch.zeros(2, 4), torch.zeros(2, 4)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x, bg), ref(x, br)), i
            assert close(bg, br), i


def test_bound_accumulator_fresh_argument_control(sim):
    """The same module passed a new buffer each call after the first: replays are right."""
    torch.manual_seed(0)
    ref = KeepsAccumulator()
    g = cg.graphify(copy.deepcopy(ref))
    bg, br = torch.zeros(2, 4), torch.zeros(2, 4)
    with torch.no_grad():
        x = torch.randn(2, 4)
        assert close(g(x, bg), ref(x, br))
        for i in range(4):
            x, b = torch.randn(2, 4), torch.randn(2, 4)
            assert close(g(x, b.clone()), ref(x, b.clone())), i
            assert close(g.acc, ref.acc), i
    assert cg.stats(g).replays >= 1


# -- F-B (wrong values / state, introduced by 27cfff6 (H)): a lazy head first reached by a run
#    that is not a call ------------------------------------------------------------------------


class Prev(nn.Module):
    """A streaming model: from the second call of a sequence on, it adds the previous
    features and runs a lazy head. ``prev = None`` starts a new sequence."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.LazyLinear(3)
        self.prev = None

    def forward(self, x):
        h = self.lin(x)
        if self.prev is None:
            self.prev = h.detach().clone()
            return h[:, :3]
        return self.head(h + self.prev)


def _stream(g, ref, calls=6, resets=2, train=False):
    with torch.set_grad_enabled(train):
        for i in range(calls):
            if i < resets:
                g.prev = ref.prev = None  # a new sequence
            x = torch.randn(2, 4)
            torch.manual_seed(100 + i)
            a = g(x)
            torch.manual_seed(100 + i)
            b = ref(x)
            assert close(a, b), i
            if train:
                a.sum().backward()
                b.sum().backward()
    same_params(g, ref)


@pytest.mark.parametrize("how", ["num_warmup_iters=2", "training"])
def test_finding_b_lazy_head_first_reached_in_an_extra_warm_up(sim, how):
    """With the lazy head watched instead of every call running eagerly (_engine.py:283-291,
    :756-774), a FirstCall runs for a signature while the head is still lazy. Its real call
    binds ``prev`` and does not reach the head (``initialized`` False, _first_call.py:150),
    but the extra warm-up (_capturing.py:130-148; one is forced in training) sees ``prev`` set
    and runs the head: it initializes there, in a run that is not a call, drawing its weights
    from the RNG one call early (the twin draws them on the next call), and the warm-up's
    ``_put_back`` (rec.undo, _capturing.py:112) then undoes the initializer's own attribute
    writes (``head.in_features`` stays 0). Before 27cfff6 such a call ran eagerly (statics
    lazy) and nothing but the real call ran the head."""
    torch.manual_seed(0)
    ref = Prev()
    g = cg.graphify(copy.deepcopy(ref),
                    num_warmup_iters=2 if how == "num_warmup_iters=2" else 1)
    _stream(g, ref, train=how == "training")
    assert g.head.in_features == ref.head.in_features == 4


def test_lazy_head_reached_in_a_sim_capture_control(sim):
    """num_warmup_iters=1 on the simulated backend: the capture's run reaches the head, the
    simulated capture fails on the uninitialized parameter and the call is planned
    piecewise; the head initializes on the next real call, as the twin's (on a GPU the capture
    does not fail: see .ci/review/r64/b_lazy_head_in_capture.py)."""
    torch.manual_seed(0)
    ref = Prev()
    g = cg.graphify(copy.deepcopy(ref))
    _stream(g, ref)


# -- F-C (crash / speed, introduced by 27cfff6 (H)): the lazy watcher is a closure in the
#    module's hook dict ----------------------------------------------------------------------


class LazyHead(nn.Module):
    """A lazy head run only when asked for (a flag attribute)."""

    def __init__(self, item=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.LazyLinear(3)
        self.use_head = False
        self.item = item

    def forward(self, x):
        h = self.lin(x)
        if self.item and h.sum().item() > 1e9:
            h = h * 0
        if self.use_head:
            return self.head(h)
        return torch.relu(h)


@pytest.fixture
def graphed_class():
    cg.graphify(LazyHead)
    try:
        yield LazyHead
    finally:
        cg.ungraphify(LazyHead)


def test_finding_c_torch_save_of_a_model_with_an_unused_lazy_head(sim, graphed_class):
    """``GraphedState._watch_lazy`` (_engine.py:756-774) registers ``reached``, a local closure
    over the GraphedState, as a forward pre-hook of the lazy module: it lives in the module's
    ``_forward_pre_hooks``, so ``torch.save(model)`` (a class-graphified model pickles) raises
    "Can't pickle local object 'GraphedState._watch_lazy.<locals>.reached'". The same model
    without lazy modules, and this one before 27cfff6, pickle."""
    torch.manual_seed(0)
    m = graphed_class()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(2, 4))
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert close(back(x), m(x))


def test_finding_c_deepcopy_keeps_the_originals_lazy_watcher(sim, graphed_class):
    """The copy's head keeps the original's ``reached`` hook (functions deep-copy as
    themselves) and its handles point at the original's hook dicts, so it is never removed
    from the copy: every call of the copy's head bumps the global statics generation (every
    graphified callable rescans on its next call), and the copy's own FirstCall sees a hooked
    module it ran (_first_call.py:296-318): the copy runs piecewise for good where a fresh
    instance is graphed whole."""
    from cudagraphify import _statics
    torch.manual_seed(0)
    m = graphed_class()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(2, 4))
        c = copy.deepcopy(m)
        fresh = graphed_class()
        c.use_head = fresh.use_head = True
        for _ in range(6):
            x = torch.randn(2, 4)
            torch.manual_seed(1)
            c(x)
            torch.manual_seed(1)
            fresh(x)
        g0 = _statics.generation()
        c(torch.randn(2, 4))
        bumps = _statics.generation() - g0
    sc, sf = cg.stats(c), cg.stats(fresh)
    assert not [r for r in sc.eager_calls if "hooks of head" in r], sc.eager_calls
    assert sc.replays >= sf.replays, (sc, sf)
    assert bumps == 0


# -- F-D (wrong values / state, introduced by 27cfff6 (G)): explain leaves a graphified
#    module's registries as its runs left them ------------------------------------------------


class PerTask(nn.Module):
    """A head per task made on first use; a position buffer grown to the longest batch."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 4)})
        self.register_buffer("pos", torch.arange(2.0))

    def forward(self, x, task: str = "a"):
        if task not in self.heads:
            self.heads[task] = nn.Linear(4, 4)
        if x.shape[0] > self.pos.shape[0]:
            self.register_buffer("pos", torch.arange(float(x.shape[0])))
        return self.heads[task](self.body(x)) + self.pos.mean()


@pytest.mark.parametrize("graphed", [True, False])
def test_finding_d_explain_keeps_what_its_runs_registered_in_a_graphified_module(sim, graphed):
    """``_explain._ours`` (_explain.py:230-234) counts every ``_WatchedDict`` as cudagraphify's
    own, so ``named`` and ``held`` (_explain.py:179-183) skip a graphified module's
    ``_parameters``, ``_buffers`` and ``_modules`` (graphify's first call watches them): the
    buffer and the submodule explain's runs registered stay. The next calls read the grown
    ``pos`` (wrong outputs), and ``state_dict`` has the extra head. Before 27cfff6 explain
    refilled them (the ungraphified case, the control, still does)."""
    torch.manual_seed(0)
    ref = PerTask()
    m = copy.deepcopy(ref)
    g = cg.graphify(m) if graphed else m
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
        cg.explain(g, torch.randn(3, 4), task="b")
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
    assert list(g.state_dict()) == list(ref.state_dict())


# -- F-E (wrong values, introduced by 27cfff6 (F)): a chaining region replays a write to a
#    tensor the real call made and bound -------------------------------------------------------


class KeepsH(nn.Module):
    """Keeps its first activation as a running state, bumped in place on every call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.state = None

    def forward(self, x):
        h = self.lin(x)
        if self.state is None:
            self.state = h
        self.state.add_(1)
        return h * 2


@pytest.mark.parametrize("where", ["region", "plain"])
def test_finding_e_region_chain_replays_a_write_to_a_bound_tensor_the_call_made(sim, where):
    """``_wrote_held`` (_capturing.py:177-187) now asks ``written_before_made`` for the bound
    tensors: ``state`` was made by the real call (``self.lin(x)``) and then written, so it
    does not count, and ``verify`` sets ``replay`` for a chaining region (_first_call.py:408).
    The replay after the real call (_engine.py:720-726) writes ``state`` again (the graph was
    captured reading it from outside) and hands out the graph's ``h * 2`` instead of the real
    call's (``state`` aliased ``h`` there). r63's F fix was meant for share_graph's
    ``_shared`` check (_capturing.py:299); the chain's replay needs every written bound
    tensor. ``plain`` is the control."""
    torch.manual_seed(0)
    ref = KeepsH()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            with (cg.graph_region() if where == "region" else contextlib.nullcontext()):
                a = g(x)
                b = ref(x)
                assert close(a, b), i
            assert close(g.state, ref.state), i


# -- F-F (crash, older than 27cfff6): share_graph of layers with a lazy head never run ---------


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(LazyHead() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_finding_f_share_graph_with_an_unused_lazy_head_crashes(sim):
    """README (27cfff6): a lazy head the calls do not reach stays uninitialized and the calls
    without it are graphed. ``share_graph`` on such layers (called once first) raises
    torch's RuntimeError "Can't access the shape of an uninitialized parameter" from
    ``check_layers`` -> ``first_difference`` -> ``_describe`` (_share.py:61-65, t.shape of an
    UninitializedParameter): a crash, not a usage error nor a plan."""
    torch.manual_seed(0)
    ref = Stack()
    m = copy.deepcopy(ref)
    with torch.no_grad():
        x = torch.randn(2, 4)
        assert close(m(x), ref(x))  # (the heads it does not run stay lazy)
    cg.share_graph(m.layers)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(m(x), ref(x)), i


# -- controls --------------------------------------------------------------------------------


class Hooked(nn.Module):
    """A submodule with an output-changing, counting forward hook, run only when a flag
    attribute is on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.aux = nn.Linear(4, 4)
        self.use_aux = False
        self.log = []
        self.aux.register_forward_hook(self._hook)

    def _hook(self, m, inp, out):
        self.log.append(1)
        return out * 2

    def forward(self, x):
        h = self.lin(x)
        if self.use_aux:
            h = h + self.aux(h)
        return torch.relu(h)


class Outer(nn.Module):
    def __init__(self, item):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = Hooked()
        self.item = item

    def forward(self, x):
        h = self.pre(x)
        if self.item and h.sum().item() > 1e9:
            h = h * 0
        return self.block(h) + 1


FLAGS = [False] * 3 + [True] * 3 + [False] * 2 + [True] * 3


@pytest.mark.parametrize("kind", ["root", "piece", "child"])
def test_hooked_submodule_behind_a_flag_control(sim, kind):
    torch.manual_seed(0)
    ref = Hooked() if kind == "root" else Outer(kind == "piece")
    g = cg.graphify(copy.deepcopy(ref))
    blk = (lambda m: m) if kind == "root" else (lambda m: m.block)
    with torch.no_grad():
        for i, flag in enumerate(FLAGS):
            blk(g).use_aux = blk(ref).use_aux = flag
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert len(blk(g).log) == len(blk(ref).log), i
    assert cg.stats(g).replays > 0


class LazyOuter(nn.Module):
    def __init__(self, item):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = LazyHead()
        self.item = item

    def forward(self, x):
        h = self.pre(x)
        if self.item and h.sum().item() > 1e9:
            h = h * 0
        return self.block(h) + 1


@pytest.mark.parametrize("kind", ["root", "root_item", "piece", "child"])
@pytest.mark.parametrize("train", [False, True])
def test_lazy_head_behind_a_flag_control(sim, kind, train):
    torch.manual_seed(0)
    ref = LazyHead(kind == "root_item") if kind.startswith("root") else LazyOuter(kind == "piece")
    g = cg.graphify(copy.deepcopy(ref))
    blk = (lambda m: m) if kind.startswith("root") else (lambda m: m.block)
    with torch.set_grad_enabled(train):
        for i, flag in enumerate(FLAGS):
            blk(g).use_head = blk(ref).use_head = flag
            x = torch.randn(2, 4)
            torch.manual_seed(100 + i)
            a = g(x)
            torch.manual_seed(100 + i)
            b = ref(x)
            assert close(a, b), i
            if train:
                a.sum().backward()
                b.sum().backward()
                for (n, p), q in zip(g.named_parameters(), ref.parameters()):
                    assert (p.grad is None) == (q.grad is None), (i, n)
                    if p.grad is not None:
                        assert close(p.grad, q.grad), (i, n)
                g.zero_grad()
                ref.zero_grad()
    same_params(g, ref)


def test_two_graphified_models_sharing_a_lazy_head_control(sim):
    torch.manual_seed(0)
    head = nn.LazyLinear(3)
    a_ref, b_ref = LazyHead(), LazyHead()
    a_ref.head = b_ref.head = head
    a, b = copy.deepcopy((a_ref, b_ref))
    ga, gb = cg.graphify(a), cg.graphify(b)
    with torch.no_grad():
        for i, (fa, fb) in enumerate([(0, 0)] * 3 + [(1, 0)] * 3 + [(0, 1)] * 3):
            a.use_head = a_ref.use_head = bool(fa)
            b.use_head = b_ref.use_head = bool(fb)
            x = torch.randn(2, 4)
            torch.manual_seed(i)
            o1 = (ga(x), gb(x))
            torch.manual_seed(i)
            o2 = (a_ref(x), b_ref(x))
            assert all(close(p, q) for p, q in zip(o1, o2)), i
    assert a.head is b.head


def test_ungraphify_with_the_lazy_watcher_installed_control(sim):
    torch.manual_seed(0)
    ref = LazyHead()
    m = copy.deepcopy(ref)
    g = cg.graphify(m)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x))
        cg.ungraphify(g)
        m.use_head = ref.use_head = True
        for i in range(3):
            x = torch.randn(2, 4)
            torch.manual_seed(i)
            a = m(x)
            torch.manual_seed(i)
            assert close(a, ref(x)), i
    assert not m.head._forward_pre_hooks


@pytest.mark.parametrize("graphed", [False, True])
def test_explain_refuses_a_reached_lazy_head_then_calls_control(sim, graphed):
    torch.manual_seed(0)
    ref = LazyHead()
    m = copy.deepcopy(ref)
    g = cg.graphify(m) if graphed else m
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x))
        g.use_head = ref.use_head = True
        with pytest.raises(cg.CudagraphifyUsageError):
            cg.explain(g, torch.randn(2, 4))
        for i in range(3):
            x = torch.randn(2, 4)
            torch.manual_seed(i)
            a = g(x)
            torch.manual_seed(i)
            assert close(a, ref(x)), i


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Pw(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Blk()
        self.b = Blk()

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > 1e9:
            h = h * 0
        return self.b(h)


@pytest.mark.parametrize("when", [1, 4])
def test_explain_on_a_piecewise_model_control(sim, when):
    torch.manual_seed(0)
    ref = Pw()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(8):
            if i == when:
                cg.explain(g, torch.randn(2, 4))
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
    s = cg.stats(g)
    assert s.captures == 2 and s.replays == 14, s
