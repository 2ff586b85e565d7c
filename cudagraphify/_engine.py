"""The per-callable state machine: key a call, then replay, capture, or run eagerly.

One :class:`GraphedState` exists per graphed module instance (or graphed function). A call:

1. checks the statics guard (parameters and buffers still where the graphs read them);
2. builds the signature and looks it up in the cache (the active region's, else the state's own);
3. on a hit, replays; on an eager decision, runs eagerly; on a miss, runs the call eagerly on the
   capture stream (the warm-up: that is this call's result), then captures a graph for the
   signature. A capture that fails marks the signature eager with the reason.

Nothing here touches ``torch.cuda``: the backend (``_capture``) does.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

from . import _capture, _region
from ._cache import CachePolicy, EagerEntry, GraphCache
from ._capture import _first_line
from ._errors import CaptureFailed, CudagraphifyUsageError, warn_once
from ._options import Options, Stats
from ._replay import (CapturedGraph, OutputPlanError, StaticInputs, clone_output, plan_outputs,
                      static_output)
from ._piecewise import go_piecewise, new_probe, probed, sequence_findings
from ._probe import Finding
from ._training import TrainingGraph, capture_training, warmup_backward
from ._signature import Unkeyable, build_signature, unflatten_call
from ._statics import StaticState

__all__ = ["GraphedState", "Options", "Stats", "in_graphed_call"]

_tls = threading.local()
_MAX_DEFERRED = 8  # transient capture failures before a signature is decided for good
_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_MAX_MOVES = 4  # calls that find the statics moved (with under _STILL_CALLS calls between)
_STILL_CALLS = 16  # calls without a move after which re-capturing is tried again


def in_graphed_call() -> bool:
    """True while this thread warms up or captures a graphed callable (nested calls run eagerly)."""
    return getattr(_tls, "depth", 0) > 0


class _Nested:
    def __enter__(self):
        _tls.depth = getattr(_tls, "depth", 0) + 1

    def __exit__(self, *exc):
        _tls.depth -= 1


class GraphedState:
    """Caches, counters and the lock of one graphed callable."""

    def __init__(self, module: torch.nn.Module | None, options: Options, name: str,
                 static_positions: frozenset[int], static_names: frozenset[str]):
        self.name = name
        self.options = options
        self.policy = options.cache_policy or CachePolicy(max_graphs=options.max_graphs)
        self.cache = self.policy.new_cache()
        self.statics = StaticState(module)
        self.static_positions = static_positions
        self.static_names = static_names
        self.lock = self.policy.shared_lock or threading.RLock()
        self.captures = 0
        self.capture_seconds = 0.0
        self.warmup_seconds = 0.0
        self.eager_calls: collections.Counter[str] = collections.Counter()
        self.invalidations = 0
        self._warned: set[str] = set()
        self.replays = 0
        self._retired_copies = 0
        # piecewise graphing: set by the API (it graphifies submodules); what it installed
        self.install_pieces: Callable[[list[str]], list] | None = None
        self.pieces: list = []
        self.last_plan: tuple | None = None
        self.accel = frozenset({"cuda"})  # device types whose work graphs capture
        self._deferred = 0  # captures put off by a transient failure
        self._moves = 0  # calls that found parameters or buffers moved, since they last stood
        self._still = 0  # calls in a row since the last move
        self._moved_why = ""
        self.train_eager: str | None = None  # why grad-mode calls run eagerly from now on
        self._fsdp_checked = (-1, False)  # (FSDP2 registry size, resharded by a parent)
        self._stream_token: int | None = None
        self.share: tuple | None = None  # (ShareGroup, layer index) under share_graph
        self.retargets = 0  # graphs made from a share_graph template instead of a capture

    # A copied or unpickled module starts with no graphs: graphs belong to the memory they read.
    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return (_no_state, ())

    # -- the call path ---------------------------------------------------------------------

    def __call__(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Call ``fn(*args, **kwargs)`` through the graphs of this state."""
        enabled = self.options.enabled
        if enabled is not True and not (enabled() if callable(enabled) else enabled):
            return self._eager("disabled (enabled=False)", fn, args, kwargs, warn=False)
        region = _region.current()
        if region is not None and not region.enabled:
            return self._eager("disabled by graph_region(enabled=False)", fn, args, kwargs,
                               warn=False)
        backend = _capture.default_backend()
        if in_graphed_call() or backend.in_capture():
            # Inside another graphed callable's warm-up or capture: become part of it.
            return fn(*args, **kwargs)
        if region is not None:
            with region.lock, self.lock:
                return self._call(backend, region, fn, args, kwargs)
        with self.lock:
            return self._call(backend, region, fn, args, kwargs)

    def _call(self, backend, region, fn: Callable, args: tuple, kwargs: dict) -> Any:
        moved = self.statics.changed()
        if moved is not None:
            self.invalidate(moved)
            self._moves += 1
            self._still = 0
        elif self._moves:
            self._still += 1
            if self._still >= _STILL_CALLS:
                self._moves = 0
        if torch.is_grad_enabled() and (self.train_eager
                                        or _reshards_after_forward(self.statics.root)
                                        or self._resharded_by_a_parent()):
            return self._eager(self.train_eager or _RESHARDS, fn, args, kwargs)
        if self._moves > _MAX_MOVES:
            return self._eager(
                f"parameters or buffers keep moving to new memory ({self._last_move(moved)}; "
                "FSDP2 gathers them anew when it reshards): running eagerly until they stay "
                f"put for {_STILL_CALLS} calls", fn, args, kwargs)
        sig, leaves, static_flags = build_signature(
            args, kwargs, self.statics.modules, self.static_positions, self.static_names)
        if isinstance(sig, Unkeyable):
            _refuse_tracers(args, kwargs)
            return self._eager(sig.reason, fn, args, kwargs)
        if sig.state[1] and _saved_tensors_hooks(False) is not None:
            return self._eager("inside saved-tensor hooks (activation checkpointing, "
                               "save_on_cpu): they must see the forward's own tensors, which a "
                               "graph keeps to itself", fn, args, kwargs)
        cache = region.cache_for(self) if region is not None else self.cache
        key = self.policy.full_key(sig)
        if sig.state[1] and self.statics.tensors:  # grad mode: which parameters require grad
            key = (key, self.statics.grad_pattern())
        entry = cache.get(key)
        owner = entry.owner if entry is not None else None
        if owner is not self and entry is not None:
            # A graph of another module (a shared policy): it reads that module's statics.
            if owner is None:
                if entry.orphaned:  # that module is gone, and its memory with it
                    cache.discard(key)
                    entry = None
            else:
                moved = owner.statics.changed()
                if moved is not None:
                    owner.invalidate(moved)
                    entry = None
        if entry is not None:
            kind = type(entry)
            if kind is CapturedGraph or kind is TrainingGraph:
                return self._replay(backend, region, entry, leaves, fn, args, kwargs)
            return self._eager(entry.reason, fn, args, kwargs)
        reason = self._ineligible(backend, leaves, cache)
        if reason is not None:
            return self._decide_eager(cache, key, reason, lambda: fn(*args, **kwargs))
        return self._warmup_and_capture(backend, region, cache, key, sig, leaves, static_flags,
                                        fn, args, kwargs)

    def _replay(self, backend, region, entry, leaves: list, fn, args, kwargs) -> Any:
        if entry.mutated and _inputs_alias(leaves):
            return self._eager("inputs share memory and forward writes to them", fn, args,
                               kwargs)
        training = type(entry) is TrainingGraph
        if training and entry.pending():
            return self._eager("the backward of an earlier call with this signature has not run "
                               "yet (its activations would be overwritten); call under "
                               "torch.no_grad() when no backward follows", fn, args, kwargs)
        if training and entry.grads_held(self.statics.grad_params()):
            return self._eager("a gradient this graph handed out as .grad is still referenced "
                               "through another tensor (a view of .grad kept from an earlier "
                               "step); clone gradients you keep", fn, args, kwargs)
        if not training and entry.seq is not None and not region.protect_before(entry, leaves):
            return self._eager("an output of an earlier call in this graph_region is still "
                               "referenced through a view; running eagerly so it is not "
                               "overwritten (clone outputs you keep)", fn, args, kwargs)
        device = entry.device
        holder = self._stream_holder(region)
        token = backend.stream_token(device)
        if token != holder._stream_token:
            if holder._stream_token is not None:
                # Another stream replayed last: its copies may still be in flight.
                backend.order_after(device, holder._stream_token)
            holder._stream_token = token
        self.replays += 1
        if region is not None:
            region.replays += 1
        if training:
            return entry.run(leaves, self.statics.grad_params(), self)
        return entry.run(leaves)

    def _last_move(self, moved: str | None) -> str:
        if moved is not None:
            self._moved_why = moved
        return self._moved_why

    def _stream_holder(self, region):
        """Who records the stream that replayed last: the region, the share_graph group (its
        layers use one set of buffers), or this callable."""
        if region is not None:
            return region
        return self.share[0] if self.share is not None else self

    def _eager(self, reason: str, fn: Callable, args: tuple, kwargs: dict,
               warn: bool = True) -> Any:
        self.eager_calls[reason] += 1
        if warn:
            warn_once(self._warned, self.name, reason)
        return fn(*args, **kwargs)

    def _decide_eager(self, cache: GraphCache, key, reason: str, call: Callable[[], Any]) -> Any:
        """Remember that ``key`` runs eagerly, count and warn; return ``call()``."""
        cache.put(key, EagerEntry(reason, self))
        self.eager_calls[reason] += 1
        warn_once(self._warned, self.name, reason)
        return call()

    # -- deciding and capturing ------------------------------------------------------------

    def _ineligible(self, backend, leaves: list, cache: GraphCache) -> str | None:
        devices = {leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)}
        devices |= self.statics.devices()
        if not devices:
            return "no tensors to graph (no tensor arguments, parameters or buffers)"
        if len(devices) > 1:
            return f"tensors on several devices: {sorted(map(str, devices))}"
        (device,) = devices
        if not backend.supports(device):
            if device.type == "cuda":
                return "CUDA is not available"
            return f"tensors are on {device}, not on a CUDA device"
        if cache.eviction_budget_spent():
            return (f"more than {self.policy.max_evictions} evictions: too many distinct "
                    f"signatures for max_graphs={self.policy.max_graphs}; raise max_graphs or "
                    "make the shapes static (pad)")
        self._device = device
        self.accel = frozenset({device.type})
        return None

    def _warmup_and_capture(self, backend, region, cache, key, sig, leaves, static_flags,
                            fn, args, kwargs) -> Any:
        device = self._device
        training = torch.is_grad_enabled() and (
            bool(self.statics.grad_params())
            or any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves))
        tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        marks = _marks([x for _, x in tensors])
        statics, buffers = self.statics.watchable()
        static_marks = _marks(statics, buffers)
        t0 = time.perf_counter()
        probe = new_probe(self)
        with _Nested():
            result = backend.warmup(probed(probe, lambda: fn(*args, **kwargs)), device)
        mutated = [tensors[j][0] for j in _written([x for _, x in tensors], marks)]
        wrote = _written(statics, static_marks)
        moved_statics = [statics[j] for j in wrote]
        del static_marks  # copies of the buffers

        def rehearse():
            return self._rehearse(backend, device, fn, sig, leaves, mutated, statics, buffers,
                                  wrote)
        done = lambda: result  # noqa: E731 - the warm-up was this call
        if probe is not None and probe.findings:
            rehearsal = None
            if probe.may_rehearse():
                rehearsal = rehearse()
            if rehearsal is None:
                return go_piecewise(self, cache, key, probe.unsafe_paths(),
                                    set(probe.sequences), result)
            probe = rehearsal  # what the capture must match: the path taken while captured
        if mutated and _inputs_alias(leaves):
            return self._decide_eager(cache, key, "inputs share memory and forward writes to "
                                      "them", done)
        if mutated and training:
            return self._decide_eager(cache, key, "forward writes to its tensor arguments while "
                                      "autograd records", done)
        # Objects named in static_argnames are passed as they are: extra runs would change them.
        opaque = any(c[1] == "static-object" for c in sig.constants)
        failed: CaptureFailed | None = None
        second = None
        try:
            if not opaque:
                self._extra_warmups(backend, device, fn, sig, leaves, training, moved_statics)
        except Exception as e:  # noqa: BLE001 - the real call succeeded: its result stands
            _forget_frames(e)
            failed = CaptureFailed(f"extra warm-up failed: {_first_line(e)}",
                                   transient=isinstance(e, torch.OutOfMemoryError))
        self.warmup_seconds += time.perf_counter() - t0
        try:
            if failed is not None:
                raise failed
            second = new_probe(self, thunder=False)
            run = probed(second, fn)
            with _Nested():
                if training:
                    entry = capture_training(backend, run, sig, leaves, static_flags,
                                             self.statics.grad_params(), device,
                                             self.statics.storage_ptrs(),
                                             self.statics.stand_ins)
                else:
                    entry = self._capture_inference(backend, region, run, sig, leaves,
                                                    static_flags, mutated, device, key, result,
                                                    bool(moved_statics))
        except (CaptureFailed, torch.OutOfMemoryError) as e:
            _forget_frames(e)
            if not isinstance(e, CaptureFailed):  # static buffers or a pool, before capturing
                e = CaptureFailed(f"out of memory preparing the capture: {_first_line(e)}",
                                  transient=True)
            if e.transient and self._deferred < _MAX_DEFERRED:
                self._deferred += 1
                reason = f"capture deferred (retried on a later call): {e}"
                self.eager_calls[reason] += 1
                warn_once(self._warned, self.name, reason)
                return result
            if probe is not None and self.statics.root is not None:
                failed = {"": [Finding("", "capture", (), f"capture failed: {e}")]}
                return go_piecewise(self, cache, key, failed, set(probe.sequences), result)
            return self._decide_eager(cache, key, f"capture failed: {e}", done)
        except OutputPlanError as e:
            return self._decide_eager(cache, key, str(e), done)
        shared = getattr(entry, "shared", False)  # made from a share_graph template
        if probe is not None and second is not None and not shared:
            differs = sequence_findings(probe, second)
            if differs and probe.may_rehearse() and not probe.rehearse:
                # the capture took the path the code takes while captured: compare with that
                rehearsal = rehearse()
                if rehearsal is not None:
                    differs = sequence_findings(rehearsal, second)
            if differs:
                entry.release()
                return go_piecewise(self, cache, key, differs, set(probe.sequences), result)
        entry.owner = self
        if shared:
            self.retargets += 1
        else:
            self.captures += 1
        self.capture_seconds += entry.capture_seconds
        if region is not None:
            region.record_capture(entry)
        evicted = cache.put(key, entry)
        self._retired_copies += sum(e.input_copies for e in evicted)
        if evicted:
            warn_once(self._warned, self.name,
                      f"more distinct signatures than max_graphs={self.policy.max_graphs}; "
                      "least recently used graphs are released and re-captured when needed",
                      what="evicts graphs")
        self._stream_holder(region)._stream_token = backend.stream_token(device)
        if region is not None and region.chain and entry.seq is not None and not mutated \
                and not moved_statics and not opaque:
            # In a chaining region the first call returns the graph's own (aliased) outputs, so
            # the next graphed call is captured reading them in place. Nothing was mutated, so
            # replaying once more has no effect beyond its outputs.
            return self._replay(backend, region, entry, leaves, fn, args, kwargs)
        return result

    def _rehearse(self, backend, device, fn, sig, leaves, mutated: list[int],
                  statics: list[torch.Tensor], buffers: list[bool], wrote: list[int]):
        """The probe of an eager run on which ``torch.cuda.is_current_stream_capturing()``
        answers "yes", when that path is safe and writes what the real call wrote (else None).

        Code that asks (HF transformers' mask building) takes another path while captured;
        where the code that asks is trusted to compute the same on it
        (``OpPolicy.trusts_captured_path``), the warm-up's findings (a host sync on the eager
        path) do not apply to the graph. The run reads copies of the inputs; the buffers and
        parameters it writes and the random state are restored, so only the real call's
        effect remains. The capture must then take the same path, op for op (checked as for
        any warm-up). ``statics``/``buffers``: ``StaticState.watchable()``; ``wrote``: which of
        them the real call wrote; ``mutated``: which inputs it wrote."""
        if any(c[1] == "static-object" for c in sig.constants):
            return None  # objects passed as they are: another run would change them
        marks = _marks(statics, buffers)  # buffers by value: the copies restore them
        written = set(wrote)  # by the real call
        with torch.no_grad():
            saved = {j: statics[j].clone() for j in written}
        rng = (torch.random.get_rng_state(),
               torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        copies = StaticInputs(leaves, [False] * len(leaves))
        copy_marks = _marks([b for _, b in copies.copy])
        rehearsal = new_probe(self)
        rehearsal.rehearse = True
        ran = False
        try:
            a, kw = unflatten_call(copies.leaves, sig)
            with _Nested():
                backend.warmup(probed(rehearsal, lambda: fn(*a, **kw)), device)
            ran = True
        except Exception:  # noqa: BLE001 - that path fails eagerly: keep the warm-up's plan
            pass
        finally:
            wrote = _written(statics, marks)
            with torch.no_grad():
                for j in wrote:
                    if isinstance(marks[j], torch.Tensor):
                        statics[j].data.copy_(marks[j])
                for j, v in saved.items():
                    statics[j].data.copy_(v)
            torch.random.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], device)
        # A path that writes what the eager one does not (or a parameter: restored only where
        # the real call wrote it too) is not the same computation.
        wrote_inputs = {copies.copy[k][0]
                        for k in _written([b for _, b in copies.copy], copy_marks)}
        if not ran or rehearsal.findings or not set(wrote) <= written \
                or wrote_inputs != set(mutated):
            return None
        return rehearsal

    def _extra_warmups(self, backend, device, fn, sig, leaves, training: bool,
                       moved_statics: list[torch.Tensor]) -> None:
        """Warm-up runs beyond the real call: on copies of the inputs; buffers the forward
        updates (running statistics) are restored, so only the real call's effect remains."""
        n = self.options.num_warmup_iters - 1
        if training:
            n = max(n, 1)  # the backward needs a warm-up of its own
        if n == 0:
            return
        with torch.no_grad():
            saved = [t.clone() for t in moved_statics]
        try:
            for _ in range(n):
                copies = StaticInputs(leaves, [False] * len(leaves))
                for i, buf in copies.copy:
                    buf.requires_grad_(training and leaves[i].requires_grad)
                a, kw = unflatten_call(copies.leaves, sig)
                with _Nested():
                    if training:
                        wrt = self.statics.grad_params() + [b for _, b in copies.copy]
                        backend.warmup(lambda: warmup_backward(lambda: fn(*a, **kw), wrt,
                                                               self.statics.stand_ins), device)
                    else:
                        backend.warmup(lambda: fn(*a, **kw), device)
        finally:  # a failed extra run leaves no trace in the buffers either
            with torch.no_grad():
                for t, v in zip(moved_statics, saved):
                    # through .data: the real call's autograd graph saved these buffers
                    # (BatchNorm's backward takes its running statistics) and checks versions
                    t.data.copy_(v)

    def _capture_inference(self, backend, region, fn, sig, leaves, static_flags, mutated,
                           device, key, expected, writes_statics=False) -> CapturedGraph:
        chain = region is not None and region.chain
        borrow = region.borrowable(leaves) if chain else {}
        borrow = {i: s for i, s in borrow.items() if not static_flags[i] and i not in mutated}
        inputs = StaticInputs(leaves, static_flags, {i: s.tensor for i, s in borrow.items()})
        held_before = [slot.users() for slot in borrow.values()]
        a, kw = unflatten_call(inputs.leaves, sig)
        pool = region.pool(backend, device) if region is not None else None
        made = self._shared(backend, region, key, fn, a, kw, inputs, leaves, device, expected,
                            bool(mutated) or writes_statics)
        if made is not None:
            raw, out, inputs = made
        else:
            if self.share is not None and region is None:
                pool = self.share[0].pool(backend, device)
            raw, out = backend.capture(lambda: fn(*a, **kw), device, pool=pool)
        seq, forget = None, None
        if chain:
            seq, pool_output, forget = region.adopt()
        elif self.options.copy_outputs:
            pool_output = clone_output
        else:
            pool_output = static_output
        try:
            actions, spec = plan_outputs(out, inputs, leaves, self.statics.storage_ptrs(),
                                         pool_output)
        except OutputPlanError:
            if forget is not None:
                forget()
            raw.release()
            raise
        entry = CapturedGraph(raw, inputs, mutated, actions, spec, keep=[out], device=device)
        entry.shared = made is not None
        entry.seq = seq
        entry.borrowed = list(borrow.items())
        if forget is not None:
            entry.on_release.append(forget)
        for slot, held in zip(borrow.values(), held_before):
            # outputs that are views of a borrowed input are cudagraphify's own references
            slot.own_more(slot.users() - held)
            entry.on_release.append(lambda slot=slot, n=slot.users() - held: slot.own_more(-n))
        return entry

    def _shared(self, backend, region, key, fn, a, kw, inputs, leaves, device, expected,
                writes: bool):
        """This layer's graph made from its share_graph group's template, or None."""
        if self.share is None:
            return None
        group, k = self.share
        if region is not None:
            group.refuse("called inside a graph_region (per-layer graphs in the region's pool)")
            return None
        if writes:
            # Sharing replays graphs to check them (and runs a second layer once): each replay
            # would apply the forward's writes (running statistics, a cache) once more.
            group.refuse("forward writes to its buffers or inputs")
            return None
        if not getattr(backend, "can_share", False) or not self.options.copy_outputs:
            group.refuse("the capture backend cannot read graphs" if self.options.copy_outputs
                         else "copy_outputs=False (layers share one set of output buffers)")
            return None
        return group.make(k, key, fn, a, kw, inputs, leaves, backend, device, expected)

    def _resharded_by_a_parent(self) -> bool:
        """Whether an FSDP2 group of an enclosing ``fully_shard``ed module frees some of this
        module's parameters after forward (looked up again when FSDP2's registry of sharded
        modules changes size)."""
        registry = sys.modules.get("torch.distributed._composable_state")
        mapping = getattr(registry, "_module_state_mapping", None)
        size = len(mapping) if mapping is not None else 0
        if size != self._fsdp_checked[0]:
            mine = {id(m) for m in self.statics.modules}
            self._fsdp_checked = (size, size > 0 and any(
                id(m) in mine for m in _resharded_param_owners(mapping)))
        return self._fsdp_checked[1]

    # -- upkeep ----------------------------------------------------------------------------

    def invalidate(self, why: str) -> None:
        """Drop every graph (they read memory that is no longer the module's)."""
        self.invalidations += 1
        self._fsdp_checked = (-1, False)  # the statics were re-read: its modules may differ
        self.release()
        for region in _region.all_open():
            region.forget(self)

    def release(self) -> None:
        """Release every graph of this callable's own cache."""
        self._retired_copies += sum(g.input_copies for g in self.cache.graphs(self))
        self.cache.clear(owner=self)

    def stats(self) -> Stats:
        graphs = self.cache.graphs(self)
        return Stats(
            captures=self.captures,
            replays=self.replays,
            eager_calls=dict(self.eager_calls),
            capture_seconds=self.capture_seconds,
            warmup_seconds=self.warmup_seconds,
            graph_pool_bytes=sum(g.pool_bytes for g in graphs),
            graphs=len(graphs),
            evictions=self.cache.evictions,
            invalidations=self.invalidations,
            input_copies=self._retired_copies + sum(g.input_copies for g in graphs),
            retargets=self.retargets,
        )

    def decisions(self) -> list[tuple[Any, str]]:
        """(key, 'graphed' | 'eager: reason') for each cached signature."""
        return [(k, "graphed" if isinstance(e, (CapturedGraph, TrainingGraph))
                 else f"eager: {e.reason}") for k, e in self.cache.items(self)]


def _forget_frames(error: BaseException) -> None:
    """Clear the locals of a failed capture's frames: a traceback cycle would keep its tensors
    (and their autograd graph, which blocks the next capture) alive until the GC runs."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _marks(tensors: list[torch.Tensor], by_value: list[bool] | None = None) -> list:
    """What tells, after a call, whether it wrote each tensor: its version counter, or a copy
    of its contents for inference tensors (they have no counter) and where ``by_value`` says so
    (buffers: BatchNorm's kernels update running statistics without bumping the counter)."""
    flags = by_value if by_value is not None else [False] * len(tensors)
    return [t.clone() if v or t.is_inference() else t._version for t, v in zip(tensors, flags)]


def _written(tensors: list[torch.Tensor], marks: list) -> list[int]:
    return [j for j, (t, m) in enumerate(zip(tensors, marks))
            if (not torch.equal(t, m) if isinstance(m, torch.Tensor) else t._version != m)]


_RESHARDS = ("FSDP2 shards this module (or one around it) with reshard_after_forward: it frees "
             "the parameters after forward and gathers them anew, elsewhere, for backward, "
             "where a backward graph cannot follow (inference calls still replay); shard it "
             "with reshard_after_forward=False for training graphs")


def _reshards_after_forward(module: torch.nn.Module | None) -> bool:
    """Whether FSDP2 (``fully_shard``) frees ``module``'s parameters after each forward."""
    # Looked up on the class: a module's __getattr__ raises (slowly) for a missing name, and
    # this runs on every grad-mode call.
    state = getattr(type(module), "_get_fsdp_state", None)
    if state is None:
        return False
    try:
        group = state(module)._fsdp_param_group
        return group is not None and group.post_forward_mesh_info is not None
    except Exception:  # noqa: BLE001 - FSDP2 internals asserting: cannot tell, assume it does
        return True


def _resharded_param_owners(mapping) -> Iterator[torch.nn.Module]:
    """The modules whose parameters an FSDP2 group in ``mapping`` (FSDP2's registry of sharded
    modules) frees after forward. A state whose internals cannot be read is skipped (a
    backward still checks the addresses it reads)."""
    for ref in list(mapping.values()):
        try:
            state = ref()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # older FSDP2: one group per state
                groups = [getattr(state, "_fsdp_param_group", None)]
            owners = [m for group in groups if group is not None
                      and getattr(group, "post_forward_mesh_info", None) is not None
                      for param in group.fsdp_params
                      for m in (param._module_info.module,
                                *getattr(param._module_info, "shared_modules", ()))]
        except Exception:  # noqa: BLE001 - FSDP2 internals changed or asserting
            continue
        yield from owners


def _refuse_tracers(args: tuple, kwargs: dict) -> None:
    """A clear error where a tracer calls a graphified module with its proxies for tensors
    (``thunder.jit`` over a model with graphified parts): running forward on them eagerly
    fails deep inside, and graphs could not be traced anyway."""
    if any(type(x).__module__.startswith("thunder.") for x in pytree.tree_leaves((args, kwargs))):
        raise CudagraphifyUsageError(
            "thunder.jit is tracing a graphified module (its tensors are Thunder proxies): "
            "graphify the thunder.jit'd model instead (graphify(thunder.jit(model))), or "
            "ungraphify its parts before thunder.jit")


def _no_state() -> None:
    return None


def _inputs_alias(leaves: list) -> bool:
    ptrs = [x.untyped_storage().data_ptr() for x in leaves if isinstance(x, torch.Tensor)]
    return len(set(ptrs)) != len(ptrs)
