"""Training through graphs: a forward and a backward graph per signature, in an autograd.Function.

When autograd records (grad mode on and a tensor requires grad), a signature gets two graphs
captured in one memory pool: the forward, and the backward computed by ``torch.autograd.grad``
from the forward's outputs to the tensor arguments and parameters that require grad. On replay,
an autograd.Function runs the forward graph; its backward copies the incoming gradients into
static buffers, replays the backward graph and hands the gradients to autograd, which
accumulates parameter gradients into ``.grad`` exactly as eagerly (micro-batches, hooks, DDP).
No gradient autograd or the caller keeps is ever a static buffer (see ``_hand_out``).

Never a wrong gradient: a backward whose forward's saved activations were overwritten by a
later replay of the same graph raises; so does a second backward through the same call
(``retain_graph=True``) and double backward (``create_graph=True``). A call made while the
signature's graph still waits for an earlier call's backward gets a second graph of its own
(``_engine._IN_FLIGHT``); past that it runs eagerly instead.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ._cache import Owned
from ._copies import clone_keeps, overlaps
from ._errors import CudagraphifyError
from ._replay import OutputPlanError, StaticInputs, _once, output_leaves, refuse_lost_kind
from ._signature import unflatten_call
from ._watch import set_again

__all__ = ["TrainingGraph", "capture_training", "saved_by_backward", "warmup_backward"]


_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)
_AccumulateGrad = torch._C._functions.AccumulateGrad
_use_count = torch._C._storage_Use_Count
# bumped whenever a training graph's call may have stopped being pending (its backward ran, or
# its autograd graph died): what was pending at a count is pending while the count stands
# (see _fast.Bypass.valid; one call's context replaced by the next's is still pending)
settled = [0]


def _settled(_ref=None) -> None:
    settled[0] += 1
# Why a module's training calls run eagerly once a backward found its parameters moved.
MOVED_IN_BACKWARD = ("its parameters moved to new memory between a forward and its backward "
                     "(FSDP2's reshard_after_forward): a backward graph cannot follow them")


def _grads(outputs: list[torch.Tensor], inputs: list[torch.Tensor],
           grad_outputs: list[torch.Tensor]) -> tuple:
    """``torch.autograd.grad(..., allow_unused=True)``, straight to the engine when possible.

    ``autograd.grad`` validates ``grad_outputs`` through an import of torch's symbolic-shape
    machinery (sympy) that costs seconds on first use; our grad outputs are made with
    ``empty_like``/``ones_like`` of the outputs, so there is nothing to validate.
    """
    if _run_backward is None:
        return torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, allow_unused=True)
    return _run_backward(tuple(outputs), tuple(grad_outputs), False, False, tuple(inputs), True,
                         accumulate_grad=False)


def _diff_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


@contextlib.contextmanager
def _hooks_silenced(tensors: list[torch.Tensor]):
    """Tensor hooks (``register_hook``) of ``tensors`` do not fire inside the block.

    Our extra warm-up and capture backwards are not the user's backwards: a hook must see the
    gradient of each real backward once, never a capture's (whose buffers hold no values yet).
    """
    saved = [(d, dict(d)) for d in (getattr(t, "_backward_hooks", None) for t in tensors) if d]
    for d, _ in saved:
        d.clear()
    try:
        yield
    finally:
        for d, hooks in saved:
            d.update(hooks)


@contextlib.contextmanager
def saved_by_backward():
    """Collect the tensors autograd saves for backward inside the block (a list, filled as it
    runs). A graphed training call saves the same ones (by position) so that autograd checks
    their versions at backward, as it does eagerly: a tensor changed in place between forward
    and backward raises the error eager raises, never a silent gradient."""
    packed: list[torch.Tensor] = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield packed


def warmup_backward(fn: Callable[[], Any], params: list[torch.Tensor],
                    stand_ins=contextlib.nullcontext) -> None:
    """One forward and backward on copies, without touching ``.grad`` (lazy init of backward).

    ``params`` are the module's (under ``stand_ins()``, their aliases are used) and the copied
    inputs."""
    with stand_ins() as aliases:
        out = fn()
        params = [(aliases or {}).get(id(p), p) for p in params]
    outs = _diff_outputs(out)
    inputs = [p for p in params if p.requires_grad]
    if outs and inputs:
        with _hooks_silenced(inputs):
            _grads(outs, inputs, [torch.ones_like(o) for o in outs])


class TrainingGraph(Owned):
    """The forward and backward graphs of one signature, and their static buffers."""

    handed = ()  # (its outputs are always copies: see CapturedGraph.handed)
    trial = None  # a piece's forward graph timed against its eager run (see _trial)
    # why no second graph of its signature could be made while it waits for its backward
    # (see _engine._another_in_flight): then calls like that run eagerly
    no_other: str | None = None
    # the version counters its forward's in-place writes move (buffers, frozen parameters,
    # tensors read from outside), by as much as the capture's run did
    # (_capturing._counting_versions), and those of the buffers and frozen parameters autograd
    # saves, checked by hand at backward: a _versions.Counters (set by verify), or None
    counters = None
    sets: tuple = ()  # module attributes its forward sets to a constant (_watch.set_again)

    def __init__(self, fwd_raw, bwd_raw, inputs: StaticInputs, tensor_idx: list[int],
                 out_tensors: list[torch.Tensor], out_diff: list[bool], rebuild, spec,
                 grad_out: list[torch.Tensor], grad_in: list,
                 device: torch.device, saved: frozenset = frozenset()):
        self.raw = fwd_raw
        self.saved = sorted(saved)  # Function inputs saved for backward (version-checked)
        self._bwd_raw = bwd_raw
        self.device = device
        self.owner = None
        self.seq = None  # training graphs never chain in a region
        self.input_copies = 0
        self.mutated: list[int] = []
        self.gen = 0
        self._inputs = inputs
        self._copy = [(tensor_idx.index(i), buf) for i, buf in _once(inputs.copy)]
        self._n_user = len(tensor_idx)
        # Detached: the capture's autograd graph (and the parameters' AccumulateGrad nodes it
        # holds, created on the capture stream) must not outlive the capture.
        self._outs = [t.detach() for t in out_tensors]
        # outputs a clone would make contiguous (non-dense: a slice, ``.imag``) are copied into
        # their own strides; None where every clone is eager's layout (see capture_training)
        strided = [not clone_keeps(t) for t in out_tensors]
        self._strided = strided if any(strided) else None
        self.out_diff = out_diff
        self._rebuild = rebuild
        self._spec = spec
        self._grad_out = grad_out
        self._grad_in = grad_in  # per Function input (user tensors, then params): tensor or None
        self._last_ctx: weakref.ref | None = None
        # parameter gradients added into .grad straight from the static buffers, and static
        # buffers adopted as .grad
        self.grads_aliased = self.grads_adopted = 0
        self._watch_gradients()

    def _watch_gradients(self) -> None:
        """Parameter gradient buffers that ``_hand_out`` may hand to autograd as ``.grad``
        themselves: their storages; how many references to each are ours (on first use)."""
        n = self._n_user
        self._param_bufs = [(i, g) for i, g in enumerate(self._grad_in)
                            if i >= n and g is not None]
        self._storages = [g.untyped_storage()._cdata for _, g in self._param_bufs]
        self._own_uses: list[int] | None = None
        self._handed = False
        # buffers of one memory (autograd gave two parameters one gradient: ``w + delta``, or
        # views of one: ``cat``), by parameter index: at most one of each group is adopted as
        # ``.grad``, the others copied, as eager's AccumulateGrad copies a gradient another
        # holds (two ``.grad`` on one memory take an in-place write twice: a clip, an unscale)
        groups: dict[int, list[int]] = {}
        for i, g in self._param_bufs:
            groups.setdefault(g.untyped_storage().data_ptr(), []).append(i)
        self._shared_bufs = [idx for idx in groups.values() if len(idx) > 1]

    @property
    def saved_statics(self) -> list[torch.Tensor]:
        """The buffers and frozen parameters autograd saves (no Function input), as the user
        holds them now: version-checked by hand at backward."""
        counters = self.counters
        return counters.saved if counters is not None else []

    @property
    def pool_bytes(self) -> int:
        if self._bwd_raw is None:
            return 0
        return self.raw.pool_bytes + self._bwd_raw.pool_bytes

    @property
    def capture_seconds(self) -> float:
        if self._bwd_raw is None:
            return 0.0
        return self.raw.capture_seconds + self._bwd_raw.capture_seconds

    def output_tensors(self) -> list[torch.Tensor]:
        """The forward capture's output tensors."""
        return list(self._outs)

    def copied_indices(self) -> list[int]:
        """The leaves copied into static buffers."""
        return [i for i, _ in self._inputs.copy] if self._inputs is not None else []

    def static_leaves(self) -> list[torch.Tensor]:
        """The tensors the graph reads its inputs from."""
        return [t for t in self._inputs.leaves if isinstance(t, torch.Tensor)] \
            if self._inputs is not None else []

    def pending(self) -> bool:
        """An earlier call's backward has not run and its autograd graph is still alive."""
        ctx = self._last_ctx() if self._last_ctx is not None else None
        return ctx is not None and not getattr(ctx, "done", True)

    def grads_held(self, params: list[torch.Tensor]) -> bool:
        """Whether gradient buffers this graph handed out as ``.grad`` are still referenced by
        another tensor than their parameter's ``.grad``; a ``.grad`` that still is one
        (accumulation without zeroing) is first moved to a copy of itself (``set_``: a caller
        holding that same tensor object sees the copy too).

        Called before each replay: the forward and backward graphs write that memory (the
        backward's outputs may reuse the forward's scratch memory in the pool).
        """
        if not self._handed:
            return False
        own = self._own_uses
        held = [k for k, c in enumerate(self._storages) if _use_count(c) > own[k]]
        if not held:
            self._handed = False  # all dropped (zero_grad(set_to_none=True)): nothing to watch
            return False
        n = self._n_user
        with torch.no_grad():
            for k in held:
                grad = params[self._param_bufs[k][0] - n].grad
                if grad is not None and grad.untyped_storage()._cdata == self._storages[k]:
                    grad.set_(grad.clone())  # whoever holds this tensor object keeps its values
                grad = None  # our own reference must not count in the check below
        return any(_use_count(self._storages[k]) > own[k] for k in held)

    def run(self, leaves: list, params: list[torch.Tensor], state=None) -> Any:
        """Replay for the engine state ``state`` (the caller: its statics are checked again
        before the backward replays)."""
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        outs = _GraphedFunction.apply(self, state, *tensors, *params)
        return pytree.tree_unflatten(self._rebuild(leaves, outs), self._spec)

    def forward(self, tensors: tuple) -> list[torch.Tensor]:
        for j, buf in self._copy:
            x = tensors[j]
            if x.data_ptr() != buf.data_ptr():
                buf.copy_(x)
                self.input_copies += 1
        self.raw.replay()
        self.gen += 1
        counters = self.counters
        if counters is not None:  # (as the in-place ops the replay ran would have)
            counters.move()
        if self.sets:
            set_again(self.sets)
        if self._strided is None:
            return [o.clone() for o in self._outs]
        return [torch.empty_strided(o.size(), o.stride(), dtype=o.dtype,
                                    device=o.device).copy_(o) if s else o.clone()
                for o, s in zip(self._outs, self._strided)]

    def backward(self, ctx, grads: tuple) -> tuple:
        # (``pending`` stays true until it is done: another thread's call of it must neither
        # replay the forward, overwriting the activations this replay reads, nor take a
        # trial's verdict that releases this graph, while it runs. Not under the state's lock:
        # a caller holding it, a shared policy's or a region's, may be the one waiting here)
        try:
            return self._backward(ctx, grads)
        finally:
            ctx.done = True
            settled[0] += 1

    def _backward(self, ctx, grads: tuple) -> tuple:
        if self._bwd_raw is None:
            raise CudagraphifyError(
                "backward of a graphed call whose graph was released before the backward ran "
                "(evicted by max_graphs, invalidated by a parameter change, or its graph_region "
                "closed); run backward first, or raise max_graphs")
        if getattr(ctx, "done", False) or getattr(ctx, "started", False):
            raise CudagraphifyError(
                "backward ran twice through one graphed call (retain_graph=True); graphs do "
                "not keep activations for that: run this module eagerly (enabled=False) for it")
        if ctx.gen != self.gen:
            raise CudagraphifyError(
                "backward of a graphed call after a later call with the same signature "
                "overwrote its saved activations; run backward before calling the module again, "
                "or call it under torch.no_grad() when no backward follows")
        ctx.started = True  # (``done`` once it returns: see ``backward``)
        statics = ctx.state.statics if ctx.state is not None else None
        if statics is not None and [t.data_ptr() for t in statics.tensors] != statics.ptrs:
            # The caller's parameters or buffers (frozen ones included) moved since its forward,
            # whose guard found them where the graphs read them.
            ctx.state.refuse_training(MOVED_IN_BACKWARD)
            raise CudagraphifyError(
                "parameters moved to new memory between a graphed forward and its backward "
                "(FSDP2 with reshard_after_forward frees them after forward and gathers them "
                "anew for backward): the backward graph reads them where the forward found "
                "them. Later training calls of this module run eagerly; for graphs, shard it "
                "with reshard_after_forward=False")
        k = 0
        for diff, g in zip(self.out_diff, grads):
            if diff:
                buf = self._grad_out[k]
                k += 1
                if g is None:
                    buf.zero_()
                elif g.data_ptr() != buf.data_ptr():
                    buf.copy_(g)
        self._bwd_raw.replay()
        return self._hand_out(ctx)

    def _hand_out(self, ctx) -> tuple:
        """The gradients for autograd, each one of three ways.

        - A parameter whose AccumulateGrad node this backward runs (``.backward``, not
          ``autograd.grad``, which hands what we return to the caller) and that has no tensor
          hook that could keep its gradient:
          - ``.grad`` set (accumulation): the static buffer itself, which AccumulateGrad adds
            into ``.grad`` in place and does not keep;
          - ``.grad`` None (``zero_grad(set_to_none=True)``): the static buffer, which
            AccumulateGrad adopts as ``.grad`` (no copy, as make_graphed_callables does). Before
            the next replay overwrites it, ``grads_held`` moves a ``.grad`` still holding it to
            a copy, and any other reference to it makes that call run eagerly.
        - Anything else (inputs' gradients, parameters with tensor hooks or post-accumulate-grad
          hooks, which may read ``.grad`` on another stream where no replay could wait for
          them, ``autograd.grad``): a copy.
          (Hooks registered on the AccumulateGrad node itself, not the tensor, are not seen.)
        """
        grads, n, params = self._grad_in, self._n_user, ctx.params
        mode = [0] * len(grads)  # 0: a copy, 1: added into .grad, 2: adopted as .grad
        try:
            edges = ctx.next_functions
            will_run = torch._C._will_engine_execute_node
            for i in range(n, len(grads)):
                p, node = params[i - n], edges[i][0]
                if grads[i] is not None and node is not None and p.is_leaf \
                        and type(node) is _AccumulateGrad and not p._backward_hooks \
                        and not getattr(p, "_post_accumulate_grad_hooks", None) \
                        and will_run(node):
                    mode[i] = 1 if p.grad is not None else 2
        except RuntimeError:  # autograd.grad asks for a parameter: it keeps what we return
            mode = [0] * len(grads)
        for idx in self._shared_bufs:  # (one memory: the first adopted, the others copied)
            adopting = [i for i in idx if mode[i] == 2]
            for i in adopting[1:]:
                mode[i] = 0
        adopted = mode.count(2)
        if adopted:
            if self._own_uses is None:  # before any of ours is out: the references we hold
                self._own_uses = [_use_count(c) for c in self._storages]
            self._handed = True
        self.grads_aliased += mode.count(1)
        self.grads_adopted += adopted
        return tuple(None if g is None else g.clone() if m == 0 else g if m == 1 else g.detach()
                     for g, m in zip(grads, mode))

    def release(self) -> None:
        for raw in (self.raw, self._bwd_raw):
            if raw is not None:
                raw.release()
        self.raw = self._bwd_raw = None
        self._outs = self._grad_out = self._grad_in = []
        self._param_bufs, self._storages, self._handed = [], [], False
        self._shared_bufs = []
        self._inputs = None
        self._copy = []


class _GraphedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph: TrainingGraph, state, *tensors):
        # What eager autograd would save (found in the warm-up): its version counters are
        # checked at backward, so an in-place change in between raises as it does eagerly.
        ctx.save_for_backward(*[tensors[i] for i in graph.saved])
        outs = graph.forward(tensors)
        # (after the replay, which moved the versions of the buffers it writes as eager's
        # in-place ops do: another graph's backward that saved one of them raises, as eagerly;
        # the objects of this call, as eager's autograd keeps them: one rebound later is not
        # the one this backward reads)
        ctx.statics = graph.saved_statics
        ctx.versions = [t._version for t in ctx.statics]
        ctx.graph, ctx.state, ctx.gen, ctx.done = graph, state, graph.gen, False
        ctx.params = tensors[graph._n_user:]
        graph._last_ctx = weakref.ref(ctx, _settled)
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, graph.out_diff) if not d])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise CudagraphifyError(
                "double backward (create_graph=True) through a graphed call is not supported: "
                "the backward graph records no autograd history; run this module eagerly "
                "(graphify(..., enabled=False)) where you need higher-order gradients")
        ctx.saved_tensors  # noqa: B018 - raises if one was changed in place since forward
        for t, then in zip(ctx.statics, ctx.versions):
            if t._version != then:  # as autograd says it for a saved tensor
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                    f"{t._version}; expected version {then} instead (a buffer or frozen "
                    "parameter a graphed call's backward reads)")
        return (None, None) + ctx.graph.backward(ctx, grads)


def _plan(out: Any, leaves: list) -> tuple[list[torch.Tensor], Callable, Any]:
    """Which output leaves are graph tensors, and how to rebuild the rest (the rule of
    :func:`._replay.output_leaves`)."""
    kinds, spec = output_leaves(out, leaves)
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}  # id -> position in ``tensors``: one tensor returned twice is
    slots: list[tuple[str, Any]] = []  # one output of the graph, one object twice, as eager's
    for kind, leaf in kinds:
        if kind == "tensor":
            refuse_lost_kind(leaf)  # (the graph's outputs come back as new tensors)
            n = index.get(id(leaf))
            if n is None:
                n = index[id(leaf)] = len(tensors)
                tensors.append(leaf)
            slots.append(("t", n))
        else:
            slots.append((kind, leaf))

    def rebuild(call_leaves: list, outs: tuple) -> list:
        return [outs[v] if kind == "t" else call_leaves[v] if kind == "arg" else v
                for kind, v in slots]

    return tensors, rebuild, spec


def capture_training(backend, fn: Callable, sig, leaves: list, static_flags: list[bool],
                     params: list[torch.Tensor], device: torch.device,
                     persistent: set[int], stand_ins=contextlib.nullcontext,
                     saved: set[int] = frozenset(), watch=None) -> TrainingGraph:
    """Capture the forward and backward graphs of one signature (grad mode must be on).

    Under ``stand_ins()`` (see ``StaticState.stand_ins``) the module computes with aliases of
    ``params`` and the backward differentiates with respect to those. ``watch(backward,
    made)``, where given, is what the backward's capture runs instead of ``backward`` (a probe
    of what its Python writes: a tensor hook the forward registered, an autograd Function's
    backward), ``made`` the tensors made for it (the inputs' static copies, the incoming
    gradients' buffers).
    """
    with stand_ins() as aliases:
        return _capture_training(backend, fn, sig, leaves, static_flags, params,
                                 aliases or {}, device, persistent, frozenset(saved), watch)


def _capture_training(backend, fn, sig, leaves, static_flags, params, aliases, device,
                      persistent, saved, watch) -> TrainingGraph:
    # Inputs that require grad are always copied: their gradient flows through the Function.
    flags = [f and not (isinstance(x, torch.Tensor) and x.requires_grad)
             for x, f in zip(leaves, static_flags)]
    inputs = StaticInputs(leaves, flags)
    for i, buf in inputs.copy:
        buf.requires_grad_(leaves[i].requires_grad)
    a, kw = unflatten_call(inputs.leaves, sig)
    fwd_raw, out = backend.capture(lambda: fn(*a, **kw), device)
    try:
        out_tensors, rebuild, spec = _plan(out, leaves)
        for t in out_tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in persistent or ptr in inputs.storage_index():
                raise OutputPlanError("forward returns a parameter, a buffer or an input (or a "
                                      "view of one) while autograd records")
        for t in out_tensors:
            if t.is_conj() or t.is_neg() or (t.numel() and overlaps(t)):
                raise OutputPlanError("forward returns a tensor with conj/neg bits or that "
                                      "overlaps itself (an expand()) while autograd records: "
                                      "a graph's outputs are copies, which would not be")
        ptrs = [t.untyped_storage().data_ptr() for t in out_tensors if t.numel()]
        if len(set(ptrs)) < len(ptrs):
            raise OutputPlanError("forward returns tensors that share memory (views of one "
                                  "another) while autograd records: a graph's outputs are "
                                  "copies, which would not share it")
        diff = [t.requires_grad for t in out_tensors]
        diff_outs = [t for t in out_tensors if t.requires_grad]
        tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        wrt = [inputs.leaves[i] for i in tensor_idx] + [aliases.get(id(p), p) for p in params]
        wants = [t.requires_grad for t in wrt]
        grad_out = [torch.empty_like(t) for t in diff_outs]
        targets = [t for t, w in zip(wrt, wants) if w]
        # The real parameters too: a gradient for one means forward reached it other than
        # through its module's attributes, where the aliases do not stand in.
        bypassed = [p for p in params if id(p) in aliases]

        def backward():
            if not diff_outs or not targets:
                return []
            return list(_grads(diff_outs, targets + bypassed, grad_out))

        if watch is not None:
            backward = watch(backward, [*(b for _, b in inputs.copy), *grad_out])
        with _hooks_silenced(targets):
            bwd_raw, grads = backend.capture(backward, device, pool=fwd_raw.pool)
        reached = [i for i, g in enumerate(grads[len(targets):]) if g is not None]
        if reached:
            bwd_raw.release()
            raise OutputPlanError(
                f"forward uses {len(reached)} parameter(s) other than through its modules' "
                "attributes (a tensor kept elsewhere): their gradients cannot be captured")
        grads = grads[:len(targets)]
    except BaseException:
        fwd_raw.release()
        raise
    it = iter(grads)
    grad_in = [next(it, None) if w else None for w in wants]
    return TrainingGraph(fwd_raw, bwd_raw, inputs, tensor_idx, out_tensors, diff, rebuild, spec,
                         grad_out, grad_in, device, saved)
