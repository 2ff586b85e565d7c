"""Review of bd9c6ad (``torch.Tensor.grad_fn`` shadowed by ``_hooks._GradFnRead`` while a
``HookWatch`` is active: a read by user code that finds an autograd node refuses the signature)
and of 9dddd85/99d7faa (a first call's real call on the caller's stream, side streams primed).

The descriptor is gone since: the probe's torch function mode notes the reads it sees
(``_hooks.node_read``; torch's own files not counted but for ``Module._call_impl``'s and
``torch.autograd.graph``'s), and a run beyond the real call swaps no leaf an autograd graph holds
(``_hooks._swap_checked``). N1-N7 are fixed (plain tests now; N3: a ``ctx``'s hook registrations are
patched on ``BackwardCFunction``, a Python class). With ``probe=False`` node reads are not seen (README).

CPU, on the ``sim`` double (tests/conftest.py). Controls (what held) are plain tests. GPU side
(streams, cuBLAS priming): .ci/review/node/run_all.sh.

Findings
- N1 (big slowdown, false refusal; new): a child module with a *full* backward (pre-)hook whose
  input requires grad (any layer but the first, in training) is no longer graphed on its own:
  torch's own ``BackwardHook._apply_on_tensors`` (torch/utils/hooks.py) reads ``t.grad_fn`` in
  the child's ``_call_impl``; ``_watches`` only exempts cudagraphify's files, so torch's read
  counts as the user's. Before bd9c6ad: "hooks of b ... graphed on its own" (README: "module
  backward hooks keep the graph").
- N2 (big slowdown, false refusal; new): ``graphify`` over a ``torch.compile``'d block (README's
  composability table: "graphs replayed") in training, the block's input carrying history:
  Dynamo's ``TensorVariable`` builder (torch/_dynamo/variables/tensor.py ``value.grad_fn``) and
  AOTAutograd's metadata pass read ``grad_fn`` while compiling inside the first call: the
  block runs eagerly.
- N3 (silent wrong Python state; open, not in README's "not seen" list): an autograd.Function
  whose ``forward`` registers a hook on ``ctx`` (``ctx`` *is* the backward node:
  ``ctx.register_prehook``) reads no ``grad_fn``: graphed, the hook's Python runs in the capture's
  backward and never on replays (eager's count differs).
- N4 (silent wrong Python state; low, private API): ``TensorBase`` has a second getter for the
  node, ``_grad_fn``, not shadowed: ``h._grad_fn.register_prehook`` is the old bug unchanged.
- N5 (low): ``torch.overrides``' ``functools.cache`` of overridable functions built while the
  patch is in place (a forward whose torch function mode names ops with
  ``torch.overrides.resolve_name``, FX's ``is_tensor_method_or_property``) keeps
  ``_GradFnRead.__get__``: once the patch is gone ``resolve_name(Tensor.grad_fn.__get__)`` is
  None for the process's lifetime (Dynamo's ``get_overridable_functions`` cache derives from
  it; ``torch.distributed._shard``'s import-time ``_register_default_op(Tensor.grad_fn.__get__)``
  is the same class, for a module first imported inside a first call).
- N6 (loud failure, the user's backward raises; new for the default probe): the probe's own mode
  no longer sees a ``grad_fn`` read (the C getter's torch function dispatch now comes from
  _hooks.py, which ``_Mode.__torch_function__`` passes through as cudagraphify's own call), so
  it no longer holds the temporary view ``torch.autograd.graph.get_gradient_edge`` reads:
  ``torch.utils.swap_tensors`` in an extra warm-up, on a parameter whose AccumulateGrad the real
  call's graph holds (one reached through a list), passes its use-count check and registers
  its poisoning pre-hook on that node (a node hook, not swapped back): the first call's backward
  raises "AccumulateGrad node that was poisoned by swap_tensors". The existing control
  tests/test_review_swap2.py::test_control_a_later_run_cannot_poison_the_real_calls_accumulate_grad
  fails at bd9c6ad (passes at bd9c6ad^; with probe=False it failed before too).
- N7 (silent wrong value; new): same cause: a read of an outside tensor's ``grad_fn`` (a
  global) is no longer an OUTSIDE_TENSOR op for the probe: a forward branching on
  ``G.grad_fn is None`` is graphed, and replays keep the captured branch once the global has
  history (bd9c6ad^: refused, eager).

Held (controls): direct ``grad_fn.register_prehook``, ``get_gradient_edge(h).node`` and a
parameter's AccumulateGrad through ``view_as(p).grad_fn.next_functions``: refused, hook logs
as eager's; a ``__torch_function__`` subclass and a user torch function mode see a ``func``
that runs and that ``_policy.op_name`` names ``Tensor.grad_fn``; set/del still raise as torch's,
deepcopy/pickle of tensors and Parameters work while patched; the patch is gone after an
exception in the real call, after nested first calls, and only when the last of two threads'
watches ends; another thread's reads while patched go straight through (no finding, its own
node hooks its own); common torch.nn modules, non-reentrant checkpoint, HF Llama/GPT-2/BERT
(training; skipped without transformers): no ``Tensor.grad_fn`` refusal; a root with a full backward hook stays graphed;
the real call goes through ``warmup(on_side=False)`` once per first call, the runs beyond it
on the side stream.
"""

from __future__ import annotations

import copy
import pickle
import threading
import warnings

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn
from torch.overrides import TorchFunctionMode

import cudagraphify as cg
from cudagraphify import _hooks, _policy

from test_warmups import _twins


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _unpatched() -> bool:
    return "grad_fn" not in vars(torch.Tensor) and not _hooks._active and _hooks._users == 0


def _reasons(g) -> list[str]:
    return list(dict(cg.stats(g).eager_calls))


def _node_refusals(g) -> list[str]:
    return [r for r in _reasons(g) if "Tensor.grad_fn" in r]


def _grads_equal(ref, g) -> bool:
    return all((p.grad is None) == (q.grad is None)
               and (p.grad is None or torch.equal(p.grad, q.grad))
               for p, q in zip(ref.parameters(), g.parameters()))


def _train(ref, g, calls=4, shape=(3, 4), xgrad=False):
    torch.manual_seed(1)
    for call in range(calls):
        x = torch.randn(*shape, requires_grad=xgrad)
        a, b = ref(x), g(x)
        assert torch.equal(a, b), call
        a.sum().backward()
        b.sum().backward()
        assert _grads_equal(ref, g), call


class _Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.log: list = []

    def forward(self, x):
        return self.b(self.a(x)).sum(-1)


# -- N1: a child's full backward hook -------------------------------------------------------------

def _hook_b(m, kind):
    if kind == "full":
        m.b.register_full_backward_hook(lambda mod, gi, go: m.log.append(go[0].clone()))
    else:
        m.b.register_full_backward_pre_hook(lambda mod, go: m.log.append(go[0].clone()))


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_finding_n1_a_child_full_backward_hook_keeps_its_graph(sim, kind):
    ref, g = _twins(_Root)
    _hook_b(ref, kind)
    _hook_b(g, kind)
    _train(ref, g)
    assert len(ref.log) == len(g.log) and all(torch.equal(p, q) for p, q in zip(ref.log, g.log))
    assert not _node_refusals(g), _node_refusals(g)
    assert cg.stats(g).replays >= 4, cg.stats(g)


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_control_n1_root_full_backward_hook_and_no_grad_child(sim, kind):
    """The hook on the graphed module itself (run around its graph), and the child's under
    no_grad (no node): graphed, no grad_fn refusal."""
    ref, g = _twins(_Root)
    for m in (ref, g):
        (m.register_full_backward_hook(lambda mod, gi, go, m=m: m.log.append(go[0].clone()))
         if kind == "full" else
         m.register_full_backward_pre_hook(lambda mod, go, m=m: m.log.append(go[0].clone())))
    _train(ref, g, xgrad=True)
    assert len(ref.log) == len(g.log)
    assert not _node_refusals(g) and cg.stats(g).replays >= 3, cg.stats(g)
    ref2, g2 = _twins(_Root)
    _hook_b(ref2, kind)
    _hook_b(g2, kind)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            assert torch.equal(ref2(x), g2(x))
    assert not _node_refusals(g2) and cg.stats(g2).replays >= 4, cg.stats(g2)


# -- N2: graphify over a torch.compile'd block ----------------------------------------------------

class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.a(x))


class _WithCompiled(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.blk = torch.compile(_Block(), backend="eager")
        self.log: list = []

    def forward(self, x):
        return self.blk(self.l(x)).sum(-1)


@pytest.fixture
def _dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_finding_n2_a_compiled_block_in_training_keeps_its_graph(sim, _dynamo_reset):
    ref, g = _twins(_WithCompiled)
    _train(ref, g)
    assert not _node_refusals(g), _node_refusals(g)
    assert cg.stats(g).replays >= 3, cg.stats(g)


# -- N3, N4: node hooks no grad_fn read finds ----------------------------------------------------

class _CtxHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log: list = []
        log = self.log

        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.register_prehook(lambda go: log.append(go[0].detach().clone()))
                return x * 2

            @staticmethod
            def backward(ctx, gr):
                return gr * 2

        self.F = F

    def forward(self, x):
        return self.F.apply(self.lin(x)).sum(-1)


class _PrivateNode(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log: list = []

    def forward(self, x):
        h = self.lin(x) * 1.0
        if h.requires_grad:
            h._grad_fn.register_prehook(lambda go: self.log.append(go[0].detach().clone()))
        return h.sum(-1)


def _logs_as_eager(make):
    ref, g = _twins(make)
    _train(ref, g)
    assert len(ref.log) == len(g.log), (len(ref.log), len(g.log), cg.stats(g))
    assert all(torch.equal(p, q) for p, q in zip(ref.log, g.log))


def test_finding_n3_a_hook_on_ctx_runs_as_eager(sim):
    _logs_as_eager(_CtxHook)


def test_finding_n4_a_hook_on_the_private_grad_fn_runs_as_eager(sim):
    assert "_grad_fn" in vars(torch._C.TensorBase)
    _logs_as_eager(_PrivateNode)


# -- N5: torch.overrides' cache --------------------------------------------------------------------

class _Naming(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(torch.overrides.resolve_name(func))
        return func(*args, **(kwargs or {}))


class _NamesOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log: list = []

    def forward(self, x):
        with _Naming():
            h = self.lin(x)
        return h * 2


def test_finding_n5_overrides_cache_built_while_patched(sim):
    cache = torch.overrides._get_overridable_functions
    cache.cache_clear()
    try:
        g = cg.graphify(_NamesOps())
        g(torch.randn(3, 4))
        assert _unpatched()
        assert torch.overrides.resolve_name(torch.Tensor.grad_fn.__get__) == \
            "torch.Tensor.grad_fn.__get__"
    finally:
        cache.cache_clear()


def test_control_n5_overrides_cache_built_unpatched():
    cache = torch.overrides._get_overridable_functions
    cache.cache_clear()
    try:
        assert torch.overrides.resolve_name(torch.Tensor.grad_fn.__get__) == \
            "torch.Tensor.grad_fn.__get__"
    finally:
        cache.cache_clear()


# -- N6, N7: the probe no longer sees grad_fn reads ------------------------------------------------

class _RenewsThroughAList(nn.Module):
    """tests/test_review_swap2.py's RenewsThroughAList: swaps its weight (through a list that
    holds it) for a fresh leaf, then uses it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.ref = [self.w]
        self.log: list = []

    def forward(self, x):
        p = self.ref[0]
        torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone()))
        return x @ p


def test_finding_n6_the_real_calls_backward_runs(sim):
    ref, g = _twins(_RenewsThroughAList)
    for i in range(3):
        x = torch.randn(3, 4)
        want, got = ref(x), g(x)
        want.sum().backward()
        got.sum().backward()  # (i=0: RuntimeError, AccumulateGrad poisoned by swap_tensors)
        assert torch.equal(want, got) and torch.equal(ref.w.grad, g.w.grad), i


_G: dict = {}


class _BranchesOnAGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log: list = []

    def forward(self, x):
        h = self.lin(x)
        return h * 2 if _G["t"].grad_fn is None else h * 3


@pytest.mark.parametrize("grad", [False, True])
def test_finding_n7_a_global_read_through_grad_fn(sim, grad):
    _G["t"] = torch.randn(4)
    try:
        ref, g = _twins(_BranchesOnAGlobal)
        with torch.set_grad_enabled(grad):
            for i in range(3):
                x = torch.randn(3, 4)
                assert torch.equal(ref(x), g(x)), i
            with torch.enable_grad():
                _G["t"] = torch.randn(4, requires_grad=True) * 1  # (it has history now)
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), g(x)), cg.stats(g)
    finally:
        _G.clear()


# -- controls: what is seen ------------------------------------------------------------------------

class _Doors(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how
        self.log: list = []

    def forward(self, x):
        h = self.lin(x) * 1.0
        if torch.is_grad_enabled():
            note = (lambda *a: self.log.append(1))
            if self.how == "grad_fn":
                h.grad_fn.register_prehook(note)
            elif self.how == "gradient edge":
                torch.autograd.graph.get_gradient_edge(h).node.register_prehook(note)
            elif self.how == "accumulate grad":
                p = self.lin.weight
                p.view_as(p).grad_fn.next_functions[0][0].register_hook(note)
            elif self.how == "getattr":
                getattr(h, "grad_fn").register_hook(note)
        return h.sum(-1)


@pytest.mark.parametrize("how", ["grad_fn", "gradient edge", "accumulate grad", "getattr"])
def test_control_node_hooks_refused_as_eager(sim, how):
    ref, g = _twins(lambda: _Doors(how))
    _train(ref, g)
    assert len(ref.log) == len(g.log), (len(ref.log), len(g.log))
    assert _node_refusals(g), _reasons(g)
    assert _unpatched()


class _Sub(torch.Tensor):
    """A __torch_function__ subclass (the default handler)."""


class _Reads(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how
        self.seen: list = []

    def forward(self, x):
        h = self.lin(x)
        if self.how == "subclass":
            s = h.as_subclass(_Sub)
            self.seen.append(type(s.grad_fn).__name__)
        else:
            seen = self.seen

            class M(TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    seen.append(_policy.op_name(func))
                    return func(*args, **(kwargs or {}))

            with M():
                node = h.grad_fn
            seen.append(type(node).__name__)
        return h * 2


@pytest.mark.parametrize("how", ["subclass", "mode"])
def test_control_torch_function_sees_a_callable_named_grad_fn(sim, how):
    ref, g = _twins(lambda: _Reads(how))
    _train(ref, g, calls=3)
    assert g.seen[0] == ref.seen[0] and g.seen[0] != "NoneType", g.seen
    if how == "mode":
        assert "Tensor.grad_fn" in g.seen, g.seen
    assert _node_refusals(g)
    assert _unpatched()


class _Overrides(torch.Tensor):
    """A subclass with a grad_fn of its own: the patch on torch.Tensor must not shadow it."""

    @property
    def grad_fn(self):
        return "mine"


def test_control_subclass_own_grad_fn_wins():
    t = torch.randn(2).as_subclass(_Overrides)
    with _hooks.HookWatch():
        assert t.grad_fn == "mine"
    assert _unpatched()


# -- controls: the patch's lifetime ----------------------------------------------------------------

class _Raises(nn.Module):
    def __init__(self, exc):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.exc = exc

    def forward(self, x):
        h = self.lin(x)
        h.grad_fn  # noqa: B018 - a read
        raise self.exc("boom")


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_control_patch_gone_after_an_exception(sim, exc):
    g = cg.graphify(_Raises(exc))
    with pytest.raises(exc):
        g(torch.randn(3, 4))
    assert _unpatched()


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = cg.graphify(_Inner())
        self.lin = nn.Linear(4, 4)
        self.log: list = []
        self.depths: list = []

    def forward(self, x):
        h = self.inner(x)
        self.depths.append(_hooks._users)
        return self.lin(h).sum(-1)


def test_control_nested_first_calls(sim):
    ref, g = _twins(_Outer)
    _train(ref, g)
    assert _unpatched() and max(g.depths) >= 1
    assert not _node_refusals(g)


class _Waits(nn.Module):
    """Its first run signals ``at`` and waits for ``go``, holding the patch."""

    def __init__(self, at, go):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.at, self.go, self.first = at, go, True
        self.log: list = []

    def forward(self, x):
        h = self.lin(x)
        if self.first:
            self.first = False
            self.at.set()
            assert self.go.wait(10)
        return h.sum(-1)


def test_control_other_threads_go_straight_through(sim):
    at, go = threading.Event(), threading.Event()
    torch.manual_seed(0)
    g = cg.graphify(_Waits(at, go))
    errors, out = [], {}

    def main():
        try:
            out["y"] = g(torch.randn(3, 4))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=main)
    th.start()
    assert at.wait(10)
    try:
        # another thread (here the test's): plain eager code with a node hook
        plain, log = nn.Linear(4, 4), []
        h = plain(torch.randn(3, 4))
        h.grad_fn.register_prehook(lambda go_: log.append(1))
        h.sum().backward()
        assert log == [1]
        # and its own first call, refused for its read, while the other still holds the patch
        ref2, g2 = _twins(lambda: _Doors("grad_fn"))
        _train(ref2, g2, calls=2)
        assert len(ref2.log) == len(g2.log) and _node_refusals(g2)
    finally:
        go.set()
        th.join(20)
    assert not errors, errors
    assert not _node_refusals(g), _reasons(g)
    assert _unpatched()


# -- controls: common modules ---------------------------------------------------------------------

class _Common(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.l = nn.Linear(8, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.bn = nn.BatchNorm1d(8)
        self.log: list = []

    def forward(self, x):
        h = self.l(x)
        if self.how == "checkpoint":
            h = ckpt.checkpoint(self.enc, h, use_reentrant=False)
        elif self.how == "mha":
            h = self.mha(h, h, h)[0]
        elif self.how == "encoder":
            h = self.enc(h)
        elif self.how == "lstm":
            h = self.lstm(h)[0]
        elif self.how == "batchnorm":
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return h.sum(-1)


@pytest.mark.parametrize("how", ["checkpoint", "mha", "encoder", "lstm", "batchnorm"])
def test_control_common_modules_read_no_node(sim, how):
    ref, g = _twins(lambda: _Common(how))
    _train(ref, g, shape=(2, 3, 8))
    assert not _node_refusals(g), _reasons(g)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_control_hf_models_read_no_node(sim, arch):
    """(Skipped without transformers.)"""
    transformers = pytest.importorskip("transformers")
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), \
            transformers.LlamaForCausalLM
    elif arch == "gpt2":
        cfg, cls = transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0,
            embd_pdrop=0, attn_pdrop=0), transformers.GPT2LMHeadModel
    else:
        cfg, cls = transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0,
            attention_probs_dropout_prob=0), transformers.BertModel
    torch.manual_seed(0)
    ref = cls(cfg)
    torch.manual_seed(0)
    g = cg.graphify(cls(cfg))
    kw = {} if arch == "bert" else {"use_cache": False}
    for _ in range(3):
        ids = torch.randint(1, 64, (2, 8))
        a, b = ref(ids, **kw)[0], g(ids, **kw)[0]
        assert torch.equal(a, b)
        a.float().sum().backward()
        b.float().sum().backward()
    assert all(torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
               for p, q in zip(ref.parameters(), g.parameters()) if p.grad is not None)
    assert not _node_refusals(g), _reasons(g)
    assert cg.stats(g).replays >= 1


# -- change 2 on the double: which runs go to the caller's stream ---------------------------------

class _Spy:
    def __init__(self, backend):
        self.backend, self.calls = backend, []
        self._orig = backend.warmup

    def __enter__(self):
        def warmup(fn, device, on_side=True):
            self.calls.append(on_side)
            return self._orig(fn, device, on_side)
        self.backend.warmup = warmup
        return self

    def __exit__(self, *exc):
        del self.backend.warmup


@pytest.mark.parametrize("grad", [False, True])
def test_control_real_call_off_the_side_stream_others_on_it(sim, grad):
    ref, g = _twins(_Root, num_warmup_iters=2)
    with _Spy(sim) as spy, torch.set_grad_enabled(grad):
        torch.manual_seed(1)
        for _ in range(3):
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), g(x))
    assert spy.calls[0] is False and spy.calls.count(False) == 1, spy.calls
    assert all(spy.calls[1:]), spy.calls
    assert cg.stats(g).replays == 2
