"""A signature's first call, as named phases that return an :class:`Outcome`.

1. ``warm_up`` — the real call: eager, on the capture stream, under the probe (the ops and
   their tags, the tensors they read, the memory they write in place whichever tensor object
   it came through) and the recorder (module attributes read, modules run, module attributes
   written). Its result is this call's result.
2. ``screen`` — before anything is captured: unsafe ops (unless a rehearsal of the captured path
   clears them), submodules whose hooks must run on every call, tensors read from outside the
   arguments, parameters, buffers and module attributes, inputs that alias while written.
3. ``capture`` — the extra warm-ups (on copies, their writes undone), then the capture, again
   under the probe and the recorder.
4. ``verify`` — the capture ran the warm-up's ops (else data-dependent control flow) and wrote
   no module attribute (Python state a replay cannot repeat); the graph's guards are made from
   what the capture's run read.

Nothing here records counters or touches a cache: the engine turns the outcome into both.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from . import _cugraph, _watch, _writes
from ._capture import _first_line
from ._errors import CaptureFailed
from ._guards import FlagsGuard, StateGuard, function_bindings
from ._nested import Nested
from ._piecewise import new_probe, probed, sequence_findings
from ._probe import Finding, Probe
from ._rehearsal import rehearse, rehearsing, snapshot_states
from ._state import tensors_in as _tensors_in
from ._replay import (CapturedGraph, OutputPlanError, StaticInputs, clone_output, plan_outputs,
                      static_output)
from ._signature import Signature, storage_of, unflatten_call
from ._training import capture_training, saved_by_backward, warmup_backward
from ._watch import Recorder, recording
from ._writes import inputs_alias

__all__ = ["FirstCall", "Outcome", "GRAPHED", "EAGER", "PIECEWISE", "DEFERRED"]

GRAPHED, EAGER, PIECEWISE, DEFERRED = "graphed", "eager", "piecewise", "deferred"

@dataclass
class Outcome:
    """What a first call decided. ``kind`` is one of GRAPHED, EAGER, PIECEWISE, DEFERRED."""

    kind: str
    result: Any
    reason: str = ""
    entry: Any = None  # GRAPHED: the CapturedGraph or TrainingGraph
    findings: dict[str, list[Finding]] = field(default_factory=dict)  # PIECEWISE
    ran: set[str] = field(default_factory=set)  # PIECEWISE: module paths that ran
    guard: StateGuard | None = None  # the module state the decision depends on
    flags: FlagsGuard | None = None
    replay: bool = False  # GRAPHED: replay once now (a chaining region hands out aliases)
    shared: bool = False  # GRAPHED: made from a share_graph template
    remember: bool = True  # EAGER: decided for the signature (False: for this call only)
    quiet: bool = False  # DEFERRED: an expected first call (no warning)
    states: list = field(default_factory=list)  # GRAPHED: static state it is keyed to
    set_up: tuple = ()  # EAGER: leaves of the static states this call set up (allocated)


class FirstCall:
    """The pipeline for one signature's first call (see the module docs). ``run()`` returns
    the :class:`Outcome`; ``warmup_seconds`` how long the eager runs took."""

    def __init__(self, state, backend, region, key, sig: Signature, leaves: list,
                 static_flags: list[bool], fn: Callable, args: tuple, kwargs: dict,
                 device: torch.device):
        self.state = state  # the GraphedState: its statics, options and share group are read
        self.backend = backend
        self.region = region
        self.key = key
        self.sig = sig
        self.leaves = leaves
        self.static_flags = list(static_flags)
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.device = device
        self.statics = state.statics
        self.warmup_seconds = 0.0
        # objects passed as they are: no extra runs
        self.opaque = bool(sig.static_objects or sig.static_states)
        self.training = False
        self.result: Any = None
        self.saved: set[int] = set()  # training: Function inputs autograd saves for backward
        self.saved_statics: list[torch.Tensor] = []  # and buffers or frozen parameters it saves
        self.short_of_memory = ""  # why the inputs could not be copied to check writes
        # argument objects passed as they are, with where they are: named in static_argnames
        # (keyed by identity; what they hold is guarded per graph, and held), and recognised
        # static state such as an HF StaticCache (keyed by what it holds: never held)
        self.objects = [(_leaf_label(sig, i), leaves[i]) for i in sig.static_objects]
        self.states = [(_leaf_label(sig, i), leaves[i]) for i in sig.static_states]
        self.set_up: tuple[str, bool] | None = None  # (which, a state?) this call set up
        self.draws = False  # the warm-up drew random numbers (checked where states are passed)
        self.family = None  # the _rebase.Family this call's graph came from or founded
        self.side_effect = ""  # which of them this call changed otherwise (a step count)
        self.states_before: dict | None = {}  # copies of the states before the call

    # -- 1. warm up ------------------------------------------------------------------------

    def run(self) -> Outcome:
        self.warm_up()
        outcome = self.screen()
        if outcome is None:
            outcome = self.capture()
        if outcome.flags is None:
            outcome.flags = self.flags
        return outcome

    def warm_up(self) -> None:
        leaves, statics = self.leaves, self.statics
        self.training = torch.is_grad_enabled() and (
            bool(statics.grad_params())
            or any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves))
        tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.tensor_idx = [i for i, _ in tensors]
        marks = _writes.marks([x for _, x in tensors])
        # Copied inputs are also compared by value: a kernel launched outside torch's Python
        # API (Triton, C++) writes where neither version counters nor the probe look.
        try:
            before = {i: x.clone() for i, x in tensors if not self.static_flags[i]
                      and not x.is_inference()}
        except torch.OutOfMemoryError as e:  # the call itself must not fail for it
            before = None
            self.short_of_memory = f"out of memory preparing the capture: {_first_line(e)}"
        self.watchable, buffers = statics.watchable()
        static_marks = _writes.marks(self.watchable, buffers)
        self.probe = self.warm_probe = probe = new_probe(self.state)
        if probe is not None:
            probe.known = {storage_of(x) for _, x in tensors} | statics.storage_ptrs()
            probe.written = set()
        self.recorder = rec = Recorder()
        self.hooks_before = _watch.global_hooks()
        passed = self.objects + self.states
        before_objects = StateGuard([], objects=passed) if passed else None
        tensors_before = {id(t) for _, obj in passed for t in _tensors_in(obj)}
        rng = _rng_offset(self.device) if self.states else None
        # lists and dicts passed in, as they are: a forward that changes them (a cache grown
        # by ``kv[0] = torch.cat(...)``, ``state["acc"] = ...``) does on every call what a
        # replay, which runs no Python, would not
        containers = _container_marks((*self.args, *self.kwargs.values()))
        # the tensor arguments' own metadata, likewise (a forward's ``x.t_()``,
        # ``x.requires_grad_()``, ``x.tag = ...``: a replay changes none of it)
        metadata = [(i, _metadata(x)) for i, x in tensors]
        # the static states as the call finds them: a rehearsal or a proof runs it again on
        # copies of these, not of what it leaves
        self.states_before = snapshot_states(leaves, self.sig.static_states, self.device)
        t0 = time.perf_counter()
        with Nested(), recording(rec):
            self.result = self.backend.warmup(
                probed(probe, lambda: self.fn(*self.args, **self.kwargs)), self.device)
        self.warmup_seconds += time.perf_counter() - t0
        # a forward that draws random numbers: a graph launched by the driver (a family's
        # rebased graph, see _rebase) would replay the template's draws
        self.draws = rng is not None and _rng_offset(self.device) != rng
        self.flags = FlagsGuard()  # as the call left them
        written = probe.written if probe is not None else set()
        # A graphed function (or a forward) may run modules outside the tree it was given:
        # their parameters and buffers are guarded too.
        statics.adopt(rec.called.values())
        self.static_storages = statics.storage_ptrs()
        # Inputs that are parameters or buffers are read in place (never copied in or back);
        # their address is checked on every call (a user-marked input's is in the key).
        self.pinned = []
        for i, x in tensors:
            if not self.static_flags[i] and storage_of(x) in self.static_storages:
                self.static_flags[i] = True
                self.pinned.append((i, x.data_ptr()))
        written_idx = set(_writes.written([x for _, x in tensors], marks))
        self.mutated = sorted(
            {tensors[j][0] for j in written_idx}
            | {i for i, x in tensors if storage_of(x) in written}
            | {i for i, b in (before or {}).items() if not _writes.same_values(leaves[i], b)})
        del before
        wrote = set(_writes.written(self.watchable, static_marks)) | {
            j for j, t in enumerate(self.watchable) if storage_of(t) in written}
        self.wrote_statics = sorted(wrote)
        self.warm_guard = self._guard(rec)
        if before_objects is not None and not before_objects.unguardable \
                and not before_objects.valid():
            # A cache allocates its tensors on its first update: what this call did (and the
            # probe saw) is not what the next calls do.
            states = {id(obj) for _, obj in self.states}
            where, obj = next(((where, obj) for where, obj in passed
                               if not StateGuard([], objects=[(where, obj)]).valid()), passed[0])
            # a set-up allocates tensors; a call that only changes other values (a step
            # count) has a side effect on every call, which the capture's check refuses
            if any(id(t) not in tensors_before for t in _tensors_in(obj)):
                self.set_up = (where, id(obj) in states)
            else:
                self.side_effect = where
        del before_objects
        if not self.side_effect and _containers_changed(containers):
            self.side_effect = "a list or dict it is passed"
        del containers
        if not self.side_effect:
            i = next((i for i, m in metadata if _metadata(leaves[i]) != m), None)
            if i is not None:
                self.side_effect = (f"{_leaf_label(self.sig, i)}'s shape, strides, "
                                    "requires_grad or attributes (an in-place t_(), "
                                    "unsqueeze_(), requires_grad_(), set_())")
        del metadata
        # the capture's run must leave the static states as it found them (see verify)
        self.states_guard = StateGuard([], objects=self.states) if self.states else None

    # -- 2. screen -------------------------------------------------------------------------

    def screen(self) -> Outcome | None:
        if self.warm_guard.unguardable:  # nothing could tell a replay that it changed
            return Outcome(EAGER, self.result, reason=self.warm_guard.unguardable)
        if not torch.is_grad_enabled() and (
                (self.warm_probe is not None and self.warm_probe.grad_on)
                or any(isinstance(t, torch.Tensor) and t.grad_fn is not None
                       for t in pytree.tree_leaves(self.result))):
            # (frozen parameters now, outputs with no history: a parameter unfrozen later
            # would give them one, and a no_grad key does not hold which require grad)
            return self._eager("forward turns grad mode on itself (torch.enable_grad inside it) "
                               "under the caller's no_grad: a graph keyed to that no_grad "
                               "would return its outputs without their autograd graph")
        if not self.training and torch.is_grad_enabled() and self.statics.grad_params():
            # the warm-up ran modules outside the tree (now guarded) whose parameters require
            # grad: an inference graph would give them none; the next call is keyed with them
            return Outcome(EAGER, self.result, remember=False,
                           reason="the forward ran a module outside its own whose parameters "
                           "require grad: decided again on the next call, with them")
        if self.set_up is not None:
            where, state = self.set_up
            if state:  # keyed by what it held: calls with it in that state set it up again
                out = self._eager(f"this call sets up {where} (a cache's first update "
                                  "allocates its tensors); graphed once it is set up")
                out.set_up = tuple(self.sig.static_states)
                return out
            seen = self.state.set_up_keys
            if self.key not in seen:  # once: an object changed by every call is decided below
                if len(seen) >= 64:
                    seen.clear()
                seen.add(self.key)
                return Outcome(DEFERRED, self.result, reason="capture deferred (retried on a "
                               f"later call): this call set up {where} (its attributes "
                               "changed: a cache's first update allocates its tensors)",
                               guard=self.warm_guard, quiet=True)
        if self.side_effect:
            return self._eager(f"forward changes {self.side_effect} (not its tensors' values: "
                               "its Python state), a side effect a replay cannot repeat")
        if self.states_guard is not None and self.states_guard.unguardable:
            return self._eager(self.states_guard.unguardable)
        if self.short_of_memory:  # writes could not be checked: try again on a later call
            return Outcome(DEFERRED, self.result, reason=f"capture deferred (retried on a later "
                           f"call): {self.short_of_memory}", guard=self.warm_guard)
        probe = warm = self.probe
        findings: dict[str, list[Finding]] = {}
        if probe is not None and probe.findings:
            rehearsal = rehearse(self) if probe.may_rehearse() else None
            if rehearsal is None:
                for f in probe.findings:
                    findings.setdefault(f.path, []).append(f)
            else:
                self.probe = probe = rehearsal  # what the capture must match
        for path, f in self._hook_findings():
            findings.setdefault(path, []).append(f)
        # tensors read from outside, on the eager path and on the rehearsed one (its copies of
        # the inputs are known to it)
        for f in self._outside_tensors(warm, probe):
            findings.setdefault(f.path, []).append(f)
        mine = {id(t) for t in self.statics.tensors}
        if torch.is_grad_enabled() and any(t.requires_grad and id(t) not in mine
                                           for t in self.warm_guard.tensors):
            return self._eager("forward reads a tensor that requires grad and is no parameter "
                               "(a plain attribute, a global or a closure variable): a graph "
                               "cannot give it a gradient; register it as an nn.Parameter")
        if findings:
            ran = probe.ran() if probe is not None else {""}
            return Outcome(PIECEWISE, self.result, findings=findings, ran=ran,
                           guard=self.warm_guard)
        if self.mutated and inputs_alias(self.leaves):
            # this call's arguments, not the signature: later calls may not alias
            out = self._eager("inputs share memory and forward writes to them")
            out.remember = False
            return out
        if self.mutated and self.training:
            return self._eager("forward writes to its tensor arguments while autograd records")
        return None

    def _hook_findings(self) -> list[tuple[str, Finding]]:
        """Hooks are Python that must run on every call: a module with hooks is graphed on its
        own (its hooks run around its graph), so its parent cannot hold it in a graph."""
        root = self.statics.root
        names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
        out = []
        if self.hooks_before:
            out.append(("", Finding("", "global module hooks", ("PYTHON_HOOK",),
                                    "torch.nn.modules.module.register_module_*_hook: they run "
                                    "around every module, on every call")))
        for m in self.statics.modules:
            if m is root or not _watch.hooked(m):
                continue
            path = names.get(id(m))
            if path is None:  # a module outside the tree (a graphed function ran it)
                out.append(("", Finding("", f"hooks of {type(m).__name__}", ("PYTHON_HOOK",),
                                        "its hooks must run on every call")))
            else:
                parent = path.rpartition(".")[0]
                out.append((parent, Finding(parent, f"hooks of {path}", ("PYTHON_HOOK",),
                                            "its hooks must run on every call: it is graphed "
                                            "on its own")))
        return out

    def _outside_tensors(self, *probes: Probe | None) -> list[Finding]:
        """Tensors the runs of ``probes`` read that are neither arguments, parameters,
        buffers, module attributes nor inside a ``static_argnames`` object: nothing would tell
        a replay that one was replaced (or freed). One finding per tensor."""
        outside: dict[int, Finding] = {}
        for probe in probes:
            if probe is not None:
                for ptr, f in probe.outside.items():
                    outside.setdefault(ptr, f)
        if not outside:
            return []
        known = set(self.static_storages)
        known.update(storage_of(t) for t in self.warm_guard.tensors)
        for i in self.sig.static_objects + self.sig.static_states:
            known.update(storage_of(t) for t in _tensors_in(self.leaves[i]))
        return [Finding(f.path, f.op, f.tags,
                        f"{f.where}: a tensor that is not an argument, parameter, buffer or "
                        "module attribute (a global or a closure variable?): pass it as an "
                        "argument or register it as a buffer")
                for ptr, f in outside.items() if ptr not in known]

    def _eager(self, reason: str, guard: StateGuard | None = None) -> Outcome:
        return Outcome(EAGER, self.result, reason=reason,
                       guard=guard if guard is not None else self.warm_guard)

    # -- 3. capture ------------------------------------------------------------------------

    def capture(self) -> Outcome:
        failed: CaptureFailed | None = None
        try:
            if not self.opaque:
                self._extra_warmups()
        except Exception as e:  # noqa: BLE001 - the real call succeeded: its result stands
            _forget_frames(e)
            failed = CaptureFailed(f"extra warm-up failed: {_first_line(e)}",
                                   transient=isinstance(e, torch.OutOfMemoryError))
        second = new_probe(self.state, thunder=False)
        if second is not None:
            second.known = set()  # track what the capture's ops produce (see verify)
            second.locate = False  # (what it reads from outside is the warm-up's business)
        rec = Recorder()
        try:
            if failed is not None:
                raise failed
            run = probed(second, self.fn)
            with Nested(), recording(rec):
                if self.training:
                    entry = capture_training(
                        self.backend, run, self.sig, self.leaves, self.static_flags,
                        self.statics.grad_params(), self.device, self._persistent(),
                        self.statics.stand_ins, self.saved, self.saved_statics)
                else:
                    entry = self._capture_inference(run)
        except (CaptureFailed, torch.OutOfMemoryError) as e:
            _forget_frames(e)
            if not isinstance(e, CaptureFailed):  # static buffers or a pool, before capturing
                e = CaptureFailed(f"out of memory preparing the capture: {_first_line(e)}",
                                  transient=True)
            if e.transient:
                return Outcome(DEFERRED, self.result, reason=f"capture deferred (retried on a "
                               f"later call): {e}", guard=self.warm_guard)
            if self.probe is not None and self.statics.root is not None:
                found = {"": [Finding("", "capture", (), f"capture failed: {e}")]}
                return Outcome(PIECEWISE, self.result, findings=found,
                               ran=self.probe.ran(), guard=self.warm_guard)
            return self._eager(f"capture failed: {e}")
        except OutputPlanError as e:
            return self._eager(str(e))
        return self.verify(entry, second, rec)

    def _persistent(self) -> set[int]:
        """Storages the caller owns (parameters, buffers, tensors kept as module attributes):
        returned as they are, never treated as a graph's output slots."""
        return self.static_storages | {storage_of(t) for t in self.warm_guard.tensors}

    def _extra_warmups(self) -> None:
        """Warm-up runs beyond the real call: on copies of the inputs; what the real call
        wrote in parameters and buffers is restored after them, so only its effect remains."""
        n = self.state.options.num_warmup_iters - 1
        if self.training:
            n = max(n, 1)  # the backward needs a warm-up of its own
        if n == 0:
            return
        written = [self.watchable[j] for j in self.wrote_statics]
        with torch.no_grad():
            saved = [t.clone() for t in written]
        statics, leaves, sig, fn = self.statics, self.leaves, self.sig, self.fn
        try:
            for _ in range(n):
                copies = StaticInputs(leaves, [False] * len(leaves))
                for i, buf in copies.copy:
                    buf.requires_grad_(self.training and leaves[i].requires_grad)
                a, kw = unflatten_call(copies.leaves, sig)
                with Nested():
                    if self.training:
                        wrt = statics.grad_params() + [b for _, b in copies.copy]
                        with saved_by_backward() as packed:
                            self.backend.warmup(lambda: warmup_backward(
                                lambda: fn(*a, **kw), wrt, statics.stand_ins), self.device)
                        self.saved = _saved_indices(packed, copies, self.tensor_idx, statics)
                        storages = {storage_of(t) for t in packed} - {0}
                        self.saved_statics = [t for t in statics.tensors if not t.requires_grad
                                              and storage_of(t) in storages]
                    else:
                        self.backend.warmup(lambda: fn(*a, **kw), self.device)
        finally:  # a failed extra run leaves no trace in the buffers either
            with torch.no_grad():
                for t, v in zip(written, saved):
                    # through .data: the real call's autograd graph saved these buffers
                    # (BatchNorm's backward takes its running statistics) and checks versions
                    t.data.copy_(v)

    def _capture_inference(self, fn: Callable) -> CapturedGraph:
        region, leaves, state = self.region, self.leaves, self.state
        chain = region is not None and region.chain
        mutated = self.mutated
        borrow = region.borrowable(leaves) if chain else {}
        borrow = {i: s for i, s in borrow.items() if not self.static_flags[i] and i not in mutated}
        inputs = StaticInputs(leaves, self.static_flags, {i: s.tensor for i, s in borrow.items()})
        held_before = [slot.users() for slot in borrow.values()]
        a, kw = unflatten_call(inputs.leaves, self.sig)
        made = self._shared(fn, a, kw, inputs)
        shared = made is not None
        if made is None:
            made = self._rebased(fn, inputs)
        if made is not None:
            raw, out, inputs = made
        else:
            if region is not None:
                pool = region.pool(self.backend, self.device)
            elif state.share is not None:
                pool = state.share.group.pool(self.backend, self.device)
            elif state.options.copy_outputs is True and not state.policy.shared:
                # one pool for this callable's graphs (they never run at once, and their
                # outputs are copied out): a capture reuses what earlier ones freed
                pool = state.pool(self.backend, self.device)
            else:
                # (copy_outputs=False: the caller holds a graph's outputs until that graph's
                # next replay, and another graph's replay must not write them; a shared
                # policy: another callable replays this one's graphs, ordered on its own
                # stream only, so two of them may run at once)
                pool = None
            raw, out = self.backend.capture(lambda: fn(*a, **kw), self.device, pool=pool)
        seq, forget = None, None
        copy_outputs = state.options.copy_outputs
        if chain:
            seq, pool_output, forget, refit = region.adopt()
        elif copy_outputs:
            pool_output = clone_output
        else:
            pool_output = static_output
        try:
            actions, spec = plan_outputs(
                out, inputs, leaves, self._persistent(), pool_output,
                {id(t) for t in (*self.statics.tensors, *self.warm_guard.tensors)})
        except OutputPlanError:
            if forget is not None:
                forget()
            raw.release()
            raise
        for i in self.sig.static_states:  # keyed by what they hold: never held by a graph
            inputs.leaves[i] = None
        # (the tensors of the output only: an argument object it returns is not the graph's)
        keep = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        entry = CapturedGraph(raw, inputs, mutated, actions, spec, keep=keep,
                              device=self.device)
        if self.family is not None:  # the output plan serves every graph of the family
            self.family.made = (actions, spec, keep)
        entry.shared = shared
        entry.seq = seq
        entry.borrowed = list(borrow.items())
        if mutated and not chain and not copy_outputs:
            # The caller holds the graph's own outputs: one passed back as an input the forward
            # writes would be overwritten by the copy-back after the replay.
            entry.hazard = {storage_of(t) for t in _tensors_in(out)} - {0}
        if forget is not None:
            entry.on_release.append(forget)
            entry.after_release.append(refit)
        for slot, held in zip(borrow.values(), held_before):
            # outputs that are views of a borrowed input are cudagraphify's own references
            slot.own_more(slot.users() - held)
            entry.on_release.append(lambda slot=slot, n=slot.users() - held: slot.own_more(-n))
        return entry

    def _shared(self, fn, a, kw, inputs):
        """This layer's graph made from its share_graph group's template, or None."""
        state = self.state
        if state.share is None:
            return None
        group, k = state.share.group, state.share.layer
        if self.region is not None:
            group.refuse("called inside a graph_region (per-layer graphs in the region's pool)")
            return None
        if self.opaque:
            # a cache passed as it is (static_argnames, an HF StaticCache): checking a shared
            # graph replays it and runs a second layer, each writing the cache once more
            group.refuse("an argument is passed as it is (a cache): sharing would write it")
            return None
        if self.mutated or self.wrote_statics:
            # Sharing replays graphs to check them (and runs a second layer once): each replay
            # would apply the forward's writes (running statistics, a cache) once more.
            group.refuse("forward writes to its buffers or inputs")
            return None
        if not getattr(self.backend, "can_share", False):
            group.refuse("the capture backend cannot read graphs")
            return None
        return group.make(k, self.key, fn, a, kw, inputs, self.leaves, self.backend,
                          self.device, self.result, self.warm_guard)

    def _rebased(self, fn, inputs):
        """This call's graph as a family's template or second state (see _rebase): (raw,
        outputs, static inputs) or None (captured as any other call). Later states of a
        family are rebased by the engine before any warm-up (:meth:`_rebase.Families.entry`)."""
        from . import _rebase

        state, backend = self.state, self.backend
        if not self.sig.static_states or state.share is not None or self.region is not None \
                or self.mutated or self.wrote_statics or self.draws \
                or not _rebase.eligible(state, backend):
            return None
        idx = self.sig.static_states
        found = _rebase.family_key(state, self.sig, self.leaves)
        if found is None:
            return None
        key, layout, storages = found
        families = state.families
        family = families.get(key)
        if family is not None and not family.verified:
            families.drop(key)  # its template's graph was refused: start again
            family = None
        if family is None:
            if families.full() or not _cugraph.driver_available():
                return None
            pool = backend.new_pool(self.device)
            a, kw = unflatten_call(inputs.leaves, self.sig)
            raw, out = backend.capture(lambda: fn(*a, **kw), self.device, pool=pool,
                                       keep_graph=True)
            if any(storages.find(storage_of(t)) for t in pytree.tree_leaves(out)
                   if isinstance(t, torch.Tensor)):
                return raw, out, inputs  # returns the state's memory: no family
            self.family = _rebase.Family(raw, pool, layout, storages, inputs,
                                         _rebase.state_outputs(out, self.leaves, idx))
            families.add(key, self.family)
            return _rebase.Borrowed(raw), out, inputs
        if family.reason is not None or family.plan is not None \
                or tuple(self.pinned) != family.pinned:
            # refused for good, or (a plan) the engine declined to rebase, or another
            # parameter passed as an argument (read in place: the template reads its own)
            return None
        # a second state: captured on the template's inputs, in its pool, then diffed
        leaves = list(family.inputs.leaves)
        for i in idx:
            leaves[i] = self.leaves[i]
        with torch.no_grad():
            for i, buf in family.inputs.copy:
                buf.copy_(self.leaves[i])
        a, kw = unflatten_call(leaves, self.sig)
        raw, out = backend.capture(lambda: fn(*a, **kw), self.device, pool=family.pool,
                                   keep_graph=True)
        _rebase.diff(family, raw, storages, family.pool, self._readable(family.inputs))
        plan = family.plan
        if plan is not None and plan.unproven:
            # the proof runs the forward once more, eagerly, and the template once: on copies
            # of the states, but any other memory the forward writes would be written again.
            # (Where only slots into memory both caches hold need it, another cache, at other
            # addresses, may need none: not final.)
            final = plan.unproven > plan.same
            why = self._writes_besides(storages)
            if why:
                family.refuse(f"rebasing is not proven: {why}", final=final)
                return raw, out, family.inputs
            if self.states_before is None:
                family.refuse("rebasing is not proven: the cache could not be copied as the "
                              "call found it (too large for the free memory)", final=final)
                return raw, out, family.inputs
            _rebase.prove(family, [self.states_before[i] for i in idx], self._eager_with(idx),
                          self.leaves, backend, self.device, live=[self.leaves[i] for i in idx])
        return raw, out, family.inputs

    def _readable(self, inputs: StaticInputs) -> list[torch.Tensor]:
        """The tensors the forward may read besides static states and its pool: parameters,
        buffers, the static inputs, tensors kept as module attributes or inside objects passed
        as they are (the probe refuses a run that reads other memory)."""
        return [*self.statics.tensors, *self.warm_guard.tensors,
                *(t for t in inputs.leaves if isinstance(t, torch.Tensor)),
                *(t for _, obj in self.objects for t in _tensors_in(obj))]

    def _writes_besides(self, storages) -> str:
        """Why the warm-up's writes are not only to the static states' ``storages`` and to
        memory it made itself ("" when they are); nor, where the capture took the rehearsed
        path, the rehearsal's to its copies of the states."""
        warm, probe = self.warm_probe, self.probe
        if warm is None or warm.written is None:
            return "the probe is off (probe=False): what the forward writes is unknown"
        foreign = [p for p in warm.written_before_made if storages.find(p) is None]
        if probe is not warm:  # (a rehearsal: it wrote copies of the states)
            if probe.written is None:
                return "what the rehearsed path writes is unknown"
            foreign += [p for p in probe.written_before_made if p not in probe.states_written]
        if foreign:
            return (f"forward writes {len(foreign)} tensor(s) besides the cache (a proof "
                    "would write them again)")
        return ""

    def _eager_with(self, idx: list[int]) -> Callable[[list], Any]:
        """The call run eagerly with other objects for the static states at leaves ``idx``."""
        def run(states: list) -> Any:
            leaves = list(self.leaves)
            for i, v in zip(idx, states):
                leaves[i] = v
            a, kw = unflatten_call(leaves, self.sig)
            # (the path the template's capture took: a rehearsed one where it was)
            rehearsed = self.probe is not None and self.probe.rehearse
            with Nested():
                return self.backend.warmup(
                    rehearsing(self.state, lambda: self.fn(*a, **kw)) if rehearsed
                    else lambda: self.fn(*a, **kw), self.device)
        return run

    # -- 4. verify -------------------------------------------------------------------------

    def verify(self, entry, second: Probe | None, rec: Recorder) -> Outcome:
        shared = getattr(entry, "shared", False)  # made from a share_graph template
        probe = self.probe
        if rec.writes and not shared:
            entry.release()
            _undo_writes(rec)  # the capture's run is not a call: its Python effects go too
            return self._writes_refused(rec)
        if not shared and ((self.warm_guard.volatile and not self.warm_guard.valid()) or (
                self.states_guard is not None and not self.states_guard.valid())):
            # the capture's run changed a container or tensor the forward reads (a step count
            # in a dict): a Python side effect on every call, which a replay cannot repeat.
            # The capture's run is not a call: the attributes it set are put back.
            entry.release()
            self.warm_guard.restore()
            if self.states_guard is not None:
                self.states_guard.restore()
            return Outcome(EAGER, self.result, reason="forward changes a container, object or "
                           "tensor attribute it reads on every call (a side effect a replay "
                           "cannot repeat)")
        outside = [] if shared else self._outside_outputs(entry, second)
        if outside:
            entry.release()
            return self._eager_or_piecewise(outside)
        if probe is not None and second is not None and not shared:
            differs = sequence_findings(probe, second)
            if differs and probe.may_rehearse() and not probe.rehearse:
                # the capture took the path the code takes while captured: compare with that
                rehearsal = rehearse(self)
                if rehearsal is not None:
                    differs = sequence_findings(rehearsal, second)
                    if not differs:  # that path's own reads from outside (a global)
                        for f in self._outside_tensors(rehearsal):
                            differs.setdefault(f.path, []).append(f)
            if differs:
                entry.release()
                return Outcome(PIECEWISE, self.result, findings=differs,
                               ran=probe.ran(), guard=self.warm_guard)
        # The graph computes what the capture's run computed: it stands while what that run
        # read stands (a layer's graph made from a template: what its own warm-up read).
        guard = self.warm_guard if shared else self._guard(rec)
        if guard.unguardable:
            entry.release()
            return Outcome(EAGER, self.result, reason=guard.unguardable)
        entry.pinned = tuple(self.pinned)
        # parameters and buffers the forward writes: an argument that shares their memory must
        # not be read from a copy (checked on every call)
        entry.written_statics = frozenset(storage_of(self.watchable[j])
                                          for j in self.wrote_statics) - {0}
        # likewise a static state's memory (read and written in place; its addresses are in
        # the key, so the same for every call the entry serves)
        entry.state_storages = frozenset(storage_of(t) for _, obj in self.states
                                         for t in _tensors_in(obj)) - {0}
        chain = self.region is not None and self.region.chain and entry.seq is not None
        replay = chain and not self.mutated and not self.wrote_statics and not self.opaque
        family = self.family
        if family is not None:  # this call's graph is the family's template: it stands
            family.verified = True
            family.guard, family.flags, family.pinned = guard, self.flags, entry.pinned
        return Outcome(GRAPHED, self.result, entry=entry, guard=guard, replay=replay,
                       shared=shared, states=[obj for _, obj in self.states])

    def _outside_outputs(self, entry, second: Probe | None) -> list[Finding]:
        """Outputs that no op of the capture made and that are none of the arguments,
        parameters, buffers or module attributes (a global returned as it is): a replay would
        hand out the tensor it captured, whatever the name now refers to."""
        if second is None:
            return []
        mine = set(self._persistent()) | second.produced
        mine.update(storage_of(x) for x in self.leaves if isinstance(x, torch.Tensor))
        mine.update(storage_of(x) for x in entry.static_leaves())
        held = {storage_of(t) for _, obj in self.objects + self.states for t in _tensors_in(obj)}
        return [Finding("", "return", ("OUTSIDE_TENSOR",), (
                    f"forward returns a {tuple(t.shape)} tensor of an object passed as it is "
                    "(a cache's own tensor): a graph would hand out a copy, not that tensor")
                    if storage_of(t) in held else (
                    f"forward returns a {tuple(t.shape)} tensor that is not an argument, "
                    "parameter, buffer or module attribute (a global or a closure "
                    "variable?): pass it as an argument or register it as a buffer"))
                for t in entry.output_tensors() if storage_of(t) not in mine | {0}]

    def _eager_or_piecewise(self, findings: list[Finding],
                            guard: StateGuard | None = None) -> Outcome:
        guard = guard if guard is not None else self.warm_guard
        if self.probe is None or self.statics.root is None:
            return self._eager(f"unsafe op {findings[0]}", guard)
        found: dict[str, list[Finding]] = {}
        for f in findings:
            found.setdefault(f.path, []).append(f)
        return Outcome(PIECEWISE, self.result, findings=found, ran=self.probe.ran(),
                       guard=guard)

    def _writes_refused(self, rec: Recorder) -> Outcome:
        """A forward that sets a module attribute on every call (a counter, a cache position):
        a Python side effect a replay cannot repeat. Decided eagerly (or piecewise), under a
        guard that leaves out what the forward itself writes, else the decision would never
        hold twice."""
        module, name, _, _ = rec.writes[0]
        root = self.statics.root
        names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
        path = names.get(id(module), "")
        what = f"{type(module).__name__}.{name}"
        written = {(id(m), n) for m, n, _, _ in self.recorder.writes + rec.writes}
        guard = self._guard(self.recorder, leave_out=written)
        finding = Finding(path, f"sets {what}", ("PYTHON_STATE",),
                          "a Python side effect on every call, which a replay cannot repeat")
        return self._eager_or_piecewise([finding], guard)

    def _guard(self, rec: Recorder, leave_out: set[tuple[int, str]] = frozenset()) -> StateGuard:
        """What ``rec``'s run read, as a guard (less the attributes ``leave_out`` names)."""
        root = self.statics.root
        modules = [m for m in self.statics.modules if m is not root]
        ran = [m for m in rec.called.values() if m is not root]
        return StateGuard([r for key, r in rec.reads.items() if key not in leave_out],
                          hooks=lambda: _watch.hook_fingerprint(modules),
                          bindings=function_bindings(self.fn), ran=ran, objects=self.objects)


def _leaf_label(sig: Signature, index: int) -> str:
    """How a message names the argument that leaf ``index`` belongs to."""
    specs, names = sig.spec
    nargs = len(specs) - len(names)
    start = 0
    for k, spec in enumerate(specs):
        if index < start + spec.num_leaves:
            return f"argument {names[k - nargs]!r}" if k >= nargs else f"argument {k}"
        start += spec.num_leaves
    return f"argument leaf {index}"

def _undo_writes(rec: Recorder) -> None:
    """Put back the module attributes a run changed (the last write first)."""
    for module, name, old, _ in reversed(rec.writes):
        if old is _watch.MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = old
    _watch.bump()


def _saved_indices(packed: list[torch.Tensor], copies: StaticInputs, tensor_idx: list[int],
                   statics) -> set[int]:
    """Which tensors of a graphed training call autograd saves for backward (by storage):
    positions among the autograd Function's inputs (the user's tensors, then the parameters
    that require grad)."""
    storages = {storage_of(t) for t in packed} - {0}
    out = set()
    by_leaf = dict(copies.copy)
    for pos, i in enumerate(tensor_idx):
        buf = by_leaf.get(i)
        if buf is not None and storage_of(buf) in storages:
            out.add(pos)
    n = len(tensor_idx)
    for k, p in enumerate(statics.grad_params()):
        if storage_of(p) in storages:
            out.add(n + k)
    return out


def _container_marks(values, depth: int = 0) -> list:
    """(container, its items as they are) for every list and dict in ``values``, nested
    ones too (through tuples, lists and dicts); the items are held, not their ids, so that
    an item replaced and freed cannot pass for one at the same address."""
    out: list = []
    for v in values:
        if isinstance(v, (list, dict)):
            out.append((v, _items(v)))
            inner = v.values() if isinstance(v, dict) else v
        elif type(v) is tuple:
            inner = v
        else:
            continue
        if depth < 8:
            out += _container_marks(inner, depth + 1)
    return out


def _items(container) -> tuple:
    """A list's items, or a dict's keys and values in turn."""
    if isinstance(container, dict):
        return tuple(x for item in container.items() for x in item)
    return tuple(container)


def _metadata(t: torch.Tensor) -> tuple:
    """What an in-place metadata change of ``t`` moves (its values aside)."""
    return (t.size(), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad,
            t.is_conj(), t.is_neg(), storage_of(t),
            tuple((k, id(v)) for k, v in t.__dict__.items()))


def _containers_changed(marks: list) -> bool:
    """Whether a container of :func:`_container_marks` holds other items (or keys) now."""
    for c, items in marks:
        now = _items(c)
        if len(now) != len(items) or any(a is not b for a, b in zip(now, items)):
            return True
    return False


def _rng_offset(device: torch.device) -> int | None:
    """The offset of ``device``'s default generator (None off CUDA)."""
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.default_generators[device.index or 0].get_offset()


def _forget_frames(error: BaseException) -> None:
    """Clear the locals of a failed capture's frames: a traceback cycle would keep its tensors
    (and their autograd graph, which blocks the next capture) alive until the GC runs."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


