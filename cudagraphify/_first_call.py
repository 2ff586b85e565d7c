"""A signature's first call, as named phases that return an :class:`Outcome`.

1. ``warm_up`` — the real call: eager, on the capture stream, under the probe (the ops and
   their tags, the tensors they read, the memory they write in place whichever tensor object
   it came through) and the recorder (module attributes read, modules run, module attributes
   written). Its result is this call's result.
2. ``screen`` — before anything is captured: unsafe ops (unless a rehearsal of the captured path
   clears them), submodules whose hooks must run on every call, tensors read from outside the
   arguments, parameters, buffers and module attributes, inputs that alias while written.
3. ``capture`` — the extra warm-ups (on copies, their writes undone), then the capture, again
   under the probe and the recorder (:mod:`._capturing`).
4. ``verify`` — the capture ran the warm-up's ops (else data-dependent control flow) and wrote
   no module attribute (Python state a replay cannot repeat); the graph's guards are made from
   what the capture's run read.

Nothing here records counters or touches a cache: the engine turns the outcome into both.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from . import _watch, _writes
from ._capture import _first_line
from ._capturing import Capturing
from ._hooks import HookWatch, backward_reads
from ._guards import FlagsGuard, StateGuard, callable_state, function_bindings
from ._nested import Nested
from ._outobjects import restore, seeing_through
from ._outcome import DEFERRED, EAGER, GRAPHED, PIECEWISE, Outcome
from ._piecewise import new_probe, probed, sequence_findings
from ._probe import Finding, Probe
from ._replay import opaque_output
from ._rehearsal import borrow, confirms, lend, rehearse, snapshot_states
from ._state import changed_again, demote
from ._state import tensors_in as _tensors_in
from ._signature import Signature, is_constant, storage_of
from ._versions import Counters, moving
from ._warmups import extra_runs
from ._watch import Recorder, recording
from ._writes import inputs_alias

__all__ = ["FirstCall", "Outcome", "GRAPHED", "EAGER", "PIECEWISE", "DEFERRED"]


class FirstCall(Capturing):
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
        # (its runs see an HF DynamicCache it returns as a node of its tensors: see _outobjects)
        self.fn = seeing_through(fn)
        self.user_fn = fn
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
        self.changed_states = False  # and whether a static state among them
        self.states_before: dict | None = {}  # copies of the states before the call
        # (tensor, count): how far the capture's run moved the statics' version counters
        self.version_moves: list = []
        # tensors of modules first met in the call whose writes it could not see (see screen)
        self.new_unseen = 0
        # the rehearsal in ``probe`` was lent by another size (capture_sizes) and its capture
        # has yet to confirm it (see verify); ``may_borrow`` goes once one was not confirmed
        self.borrowed = False
        self.may_borrow = True
        self.marked = None  # (versions before the capture: see _rehearsal.mark)
        self.capture_versions: list = []  # the statics' versions before it (graph_writes)
        self.shared_sets: list = []  # a share_graph layer's: what its replay sets (_sets)
        self.run_versions: dict = {}  # what the capture's probe saw written (Probe.versions)
        self.run_layouts: dict = {}  # and the layouts of what its ops took (Probe.layouts)
        # the slots a capture read in place, counted once it is done (see _count_borrowed)
        self.borrow_counts: list = []
        # the storages from before the call that the capture's backward wrote (its Python:
        # a tensor hook, see Capturing._watch_backward): its graph is refused
        self.backward_wrote: set[int] = set()
        # the tensor hooks the forward registers (see _hooks): in the real call, and in the
        # runs beyond it (which register none)
        self.hooks = HookWatch()
        self.later_hooks = HookWatch(block=True)
        # (buffer, its copy from before the call) for the buffers the call did not write, kept
        # where no probe copies what the extra warm-ups write (see _warmups.extra_warmups)
        self.by_value: list[tuple[torch.Tensor, torch.Tensor]] = []

    # -- 1. warm up ------------------------------------------------------------------------

    def run(self) -> Outcome:
        self.warm_up()
        # (the runs beyond the real call, rehearsals, extra warm-ups, the capture, proofs,
        # register no tensor hook: their backwards must not run its Python, nor one left on a
        # parameter every later backward; one registered there refuses the graph, see verify)
        with self.later_hooks:
            outcome = self.screen()
            if outcome is None:
                outcome = self.capture()
                if self.borrowed:  # (refused before its capture could confirm the lent one)
                    again = self._afresh()
                    if again is not None:
                        outcome = again
                    elif outcome.kind == PIECEWISE:  # (planned on the path it took after all)
                        outcome.ran = self.probe.ran()
        if outcome.flags is None:
            outcome.flags = self.flags
        outcome.result = restore(outcome.result, self.fn)  # (what the eager run made)
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
            mine = statics.storage_ptrs()
            probe.known = {storage_of(x) for _, x in tensors} | mine
            probe.watch_arguments([x for _, x in tensors],
                                  [self.static_flags[i] for i, _ in tensors], mine)
            probe.written = set()
        self.recorder = rec = Recorder()
        self.hooks_before = _watch.global_hooks()
        passed = self.objects + self.states
        # one guard per object: which of them the call changes
        before_each = [(where, obj, StateGuard([], objects=[(where, obj)]))
                       for where, obj in passed]
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
        with Nested(), recording(rec), self.hooks:
            # (on the caller's stream, as the eager call it is: the user's backward of it runs
            # on the streams its forward ran on, and its tensors are the user's; see
            # _capture.CudaBackend)
            self.result = self.backend.warmup(
                probed(probe, lambda: self.fn(*self.args, **self.kwargs)), self.device,
                on_side=False)
        self.warmup_seconds += time.perf_counter() - t0
        # a forward that draws random numbers: a graph launched by the driver (a family's
        # rebased graph, see _rebase) would replay the template's draws
        self.draws = rng is not None and _rng_offset(self.device) != rng
        self.flags = FlagsGuard()  # as the call left them
        written = probe.written if probe is not None else set()
        # A graphed function (or a forward) may run modules outside the tree it was given:
        # their parameters and buffers are guarded too.
        adopted = statics.adopt(rec.called.values())
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
        if probe is None and extra_runs(self):
            # (no probe to copy what the extra warm-ups write before they write it: the copies
            # made to compare the buffers by value stand in for those the call did not write)
            self.by_value = [(t, m) for j, (t, m) in enumerate(zip(self.watchable, static_marks))
                             if isinstance(m, torch.Tensor) and j not in wrote]
        del static_marks
        if adopted:
            # modules first met in this call (one it reached outside its tree, a graphed
            # function's): their tensors had no marks before the call. A parameter is written
            # where the probe saw an in-place op on its memory; a buffer's write may be none the
            # probe knows (BatchNorm's running statistics), and with no probe neither is seen:
            # the next call of the key decides (see screen), with marks for them; a key met
            # with new modules again (one made on every call) counts those as written (the runs
            # that are not calls put them back)
            old = {id(t): j for j, t in enumerate(self.watchable)}
            watchable, is_buffer = statics.watchable()
            new = [k for k, t in enumerate(watchable) if id(t) not in old]
            unseen = [k for k in new if is_buffer[k] or probe is None]
            self.watchable = watchable
            wrote = {k for k, t in enumerate(watchable)
                     if (old[id(t)] in wrote if id(t) in old else storage_of(t) in written)}
            if unseen:
                seen = self.state.adopt_keys
                if self.key in seen:
                    wrote |= set(unseen)
                else:
                    if len(seen) >= 64:
                        seen.clear()
                    seen.add(self.key)
                    self.new_unseen = len(unseen)
        self.wrote_statics = sorted(wrote)
        # (a tensor whose layout it changed, ``resize_`` on a log kept as an attribute, is held
        # but its layout not checked: its module runs eagerly for it, see note_relayouts, and
        # that decision holds while the tensor changes on every call)
        self.warm_guard = self._guard(rec, loose=probe.relaid if probe is not None else ())
        changed = [(where, obj) for where, obj, guard in before_each
                   if not guard.unguardable and not guard.valid()]
        del before_each
        if changed:
            # A cache allocates its tensors on its first update: what this call did (and the
            # probe saw) is not what the next calls do.
            states = {id(obj) for _, obj in self.states}
            allocated = [(where, obj) for where, obj in changed
                         if any(id(t) not in tensors_before for t in _tensors_in(obj))]
            # a set-up allocates tensors; a call that only changes other values (a step
            # count) has a side effect, which the capture's check refuses
            if allocated:
                where, obj = allocated[0]
                self.set_up = (where, id(obj) in states)
            else:
                self.side_effect = changed[0][0]
                self.changed_states = any(id(obj) in states for _, obj in changed)
                for _, obj in changed:
                    # (keyed by what it holds: a state changed on every call is a new key every
                    # call; changed on two calls, it is taken to be such)
                    if id(obj) in states and changed_again(obj):
                        demote(obj)
        if self.set_up is None and not self.side_effect:
            # an attribute it bound to tensors where it held none (a cache or an EMA allocated
            # on first use: ``if self.kc is None: self.kc = torch.zeros(...)``): the next calls
            # take the other path, the capture's run would too (ops that differ)
            made = next(((module, name) for module, name, old, new in rec.writes
                         if (old is None or old is _watch.MISSING) and _tensors_in(new)), None)
            if made is not None:
                self.set_up = (f"{type(made[0]).__name__}.{made[1]}", False)
        if self.set_up is None and not self.side_effect and probe is not None \
                and probe.first_memory:
            # an empty tensor kept outside the call given its memory (a workspace that
            # ``resize_`` sets up on first use): decided again on the next call, which may not
            # change its layout (a log grown on every call does: then it runs eagerly)
            self.set_up = (f"{probe.first_memory[0]}, an empty tensor given memory", False)
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
        out = self._screen()
        if out is not None and self.borrowed:  # (decided before a capture could confirm it)
            out = self._afresh()
        return out

    def _afresh(self) -> Outcome | None:
        """What screen decides with a rehearsal of this call's own, the lent one forgotten (no
        capture confirmed it): the outcome this call has without it (None: it captures)."""
        self.borrowed = self.may_borrow = False
        self.probe = self.warm_probe
        return self._screen()

    def _rehearsal(self, second: Probe | None = None) -> Probe | None:
        """A rehearsal of the path taken while captured: one that an earlier size of
        capture_sizes lent, where this call looked the same (see :mod:`._rehearsal`; in screen,
        ``borrowed`` until the capture confirms it; in verify, confirmed by the capture's run,
        ``second``), else this call's own."""
        lent = borrow(self) if self.may_borrow else None
        if lent is not None:
            if second is None:
                self.borrowed = True
                return lent
            if confirms(self, lent, second):
                return lent
        return rehearse(self)

    def _screen(self) -> Outcome | None:
        if self.warm_guard.unguardable:  # nothing could tell a replay that it changed
            return Outcome(EAGER, self.result, reason=self.warm_guard.unguardable)
        if self.hooks.found:
            # a tensor hook the forward registers (see _hooks): decided before any run beyond
            # the real call, whose backward would run its Python; its submodules that register
            # none are graphed (each checked on its own first call)
            return self._eager_or_piecewise(self.hooks.found)
        if self.training:
            # an autograd Function's backward that reads a tensor from outside: no guard
            # sees a rebinding of it (the forward's outside reads are screened and guarded)
            found = backward_reads(pytree.tree_leaves(self.result))
            if found:
                return self._eager_or_piecewise(found)
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
        if self.new_unseen:
            # (once per such module: the next call knows its buffers)
            return Outcome(DEFERRED, self.result, reason="capture deferred (retried on a later "
                           f"call): the call ran modules first met in it, with {self.new_unseen} "
                           "tensor(s) whose writes it could not see (no copy of them was taken "
                           "before it)", guard=self.warm_guard, quiet=True)
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
            out = self._eager(f"forward changes {self.side_effect} (not its tensors' values: "
                              "its Python state), a side effect a replay cannot repeat")
            # (a static state's: keyed by what it holds, the key met again only where a new
            # cache lies where a dead one did; each such call probed, so that a cache changed
            # on two calls is seen to be: see _state.changed_again)
            out.remember = not self.changed_states
            return out
        if self.states_guard is not None and self.states_guard.unguardable:
            return self._eager(self.states_guard.unguardable)
        if self.statics.opaque is not None:  # (a module the call ran outside its tree)
            return self._eager(self.statics.opaque)
        if self.training and len(self.sig.spec) > 2 \
                and any(self.leaves[i].requires_grad for i, _ in self.sig.spec[2]):
            return self._eager("a tensor that requires grad is passed twice: a graph gives each "
                               "input a copy and a gradient of its own, so the forward would "
                               "not see one tensor (x is y) where the call does")
        if self.short_of_memory:  # writes could not be checked: try again on a later call
            return Outcome(DEFERRED, self.result, reason=f"capture deferred (retried on a later "
                           f"call): {self.short_of_memory}", guard=self.warm_guard)
        probe = warm = self.probe
        findings: dict[str, list[Finding]] = {}
        if probe is not None and probe.findings:
            rehearsal = self._rehearsal() if probe.may_rehearse() else None
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
        opaque = opaque_output(self.result, self.leaves) if probe is not None else None
        if opaque is not None:
            # an object no replay can return (an HF EncoderDecoderCache it makes): the module
            # runs eagerly, its submodules graphed as pieces (each decides its own calls)
            findings.setdefault("", []).append(Finding("", "output", ("OPAQUE",), opaque))
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
        """Hooks are Python that must run on every call: a module with hooks that the call ran
        is graphed on its own (its hooks run around its graph), so its parent cannot hold it in
        a graph."""
        root = self.statics.root
        names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
        out = []
        if self.hooks_before:
            out.append(("", Finding("", "global module hooks", ("PYTHON_HOOK",),
                                    "torch.nn.modules.module.register_module_*_hook: they run "
                                    "around every module, on every call")))
        ran = self.recorder.called
        for m in self.statics.modules:
            # (a module the call did not run holds no graph: its hooks run when it does, a
            # lazy head's initializer among them)
            if m is root or not _watch.hooked(m) or id(m) not in ran:
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

    # -- 4. verify -------------------------------------------------------------------------

    def verify(self, entry, second: Probe | None, rec: Recorder) -> Outcome:
        shared = getattr(entry, "shared", False)  # made from a share_graph template
        probe = self.probe
        if rec.writes and not shared:
            entry.release()
            self._put_back(rec)  # the capture's run is not a call: its Python effects go too
            return self._writes_refused(rec)
        # (a layer's graph made from a template: its runs on the cache too)
        if (not shared and self.warm_guard.volatile and not self.warm_guard.valid()) or (
                self.states_guard is not None and not self.states_guard.valid()):
            # the capture's run changed a container or tensor the forward reads (a step count
            # in a dict): a Python side effect on every call, which a replay cannot repeat.
            # The capture's run is not a call: the attributes it set are put back.
            entry.release()
            self._put_back(rec)
            return Outcome(EAGER, self.result, reason="forward changes a container, object or "
                           "tensor attribute it reads on every call (a side effect a replay "
                           "cannot repeat)")
        outside = [] if shared else self._outside_outputs(entry, second)
        if outside:
            entry.release()
            return self._eager_or_piecewise(outside)
        if self.borrowed:
            self.borrowed = False
            if not confirms(self, probe, second):
                # (the capture did not show the lent rehearsal's path, or writes or reads
                # another's: decided as without it)
                again = self._afresh()
                if again is not None:
                    entry.release()
                    return again
                probe = self.probe
        rehearsed = probe if probe is not None and probe.rehearse else None  # (lent, below)
        if probe is not None and second is not None and not shared:
            differs = sequence_findings(probe, second)
            if differs and probe.may_rehearse() and not probe.rehearse:
                # the capture took the path the code takes while captured: compare with that
                rehearsal = self._rehearsal(second)
                if rehearsal is not None:
                    differs = sequence_findings(rehearsal, second)
                    if not differs:  # that path's own reads from outside (a global)
                        for f in self._outside_tensors(rehearsal):
                            differs.setdefault(f.path, []).append(f)
                        rehearsed = rehearsal
            if differs:
                entry.release()
                return Outcome(PIECEWISE, self.result, findings=differs,
                               ran=probe.ran(), guard=self.warm_guard)
        if self.later_hooks.found and not shared:
            # a tensor hook registered by a run beyond the real call only (a later path's, or
            # one the capture's path takes): blocked there, and the graph refused (a layer's
            # graph made from a share_graph template: inference, what its template's call did)
            entry.release()
            self._put_back(rec)
            return self._eager_or_piecewise(self.later_hooks.found)
        swapped = self.later_hooks.swaps_seen()
        if swapped:
            # tensors swapped (torch.utils.swap_tensors) by a run beyond the real call: every
            # later call would swap them, a replay does not (swapped back: see _writes); a
            # layer's graph made from a share_graph template too (its template's runs swapped)
            entry.release()
            self._put_back(rec)
            return self._eager_or_piecewise(swapped)
        # The graph computes what the capture's run computed: it stands while what that run
        # read stands (a layer's graph made from a template: what its own warm-up read).
        guard = self.warm_guard if shared else self._guard(rec)
        if guard.unguardable:
            entry.release()
            return Outcome(EAGER, self.result, reason=guard.unguardable)
        entry.pinned = tuple(self.pinned)
        sets = self._sets(self.shared_sets if shared else rec.sets, rec.reads)
        if sets:  # (a replay sets them again, as a call would)
            entry.sets = sets
            if not self.training:
                entry._replay = _watch.setting(entry._replay, sets)
        if not self.training and not torch.is_grad_enabled() and any(
                p is not None and p.reads_requires_grad for p in (self.warm_probe, second)):
            entry.grads_read = self.statics.grad_pattern()
        # parameters and buffers the forward writes, the real call or the graph: an argument
        # that shares their memory must not be read from a copy (checked on every call)
        graph_writes = self.graph_writes(second)
        entry.written_statics = frozenset(storage_of(self.watchable[j])
                                          for j in graph_writes) - {0}
        if self.mutated:  # (an argument it writes: eager writes a parameter it aliases, then
            # reads it; a replay would write the argument's copy and read the parameter as it was)
            entry.read_statics = frozenset(self.static_storages) - {0}
        # (the version counters its replay moves, and a training graph's backward checks)
        if self.version_moves or self.saved_statics:
            entry.counters = Counters(self.statics, self.version_moves,
                                      self.saved_statics if self.training else [])
            if not self.training and entry.counters.written:
                entry._replay = moving(entry._replay, entry.counters)
        # likewise a static state's memory (read and written in place; its addresses are in
        # the key, so the same for every call the entry serves)
        entry.state_storages = frozenset(storage_of(t) for _, obj in self.states
                                         for t in _tensors_in(obj)) - {0}
        # and the tensors it reads in place from outside its arguments, parameters and buffers
        # (plain attributes, closures, globals: the guard holds them), written or not, and
        # those the real call bound to attributes
        # (only those some op of the real call or the capture read or wrote: one read for
        # ``is None`` or its shape, ``if self.first is None: self.first = x``, is no matter)
        warm = self.warm_probe
        touched = None if second is None or second.written is None or warm is None \
            or warm.written is None \
            else set(second.outside) | second.written | set(warm.outside) | warm.written
        entry.held_storages = frozenset(
            p for p in map(storage_of, self.held_tensors())
            if touched is None or p in touched) - {0}
        chain = self.region is not None and self.region.chain and entry.seq is not None
        # (the real call ran the forward: a replay now gives the chain the graph's own outputs,
        # and repeats its writes, fine for none but those the real call made; a tensor read from
        # outside that it wrote would be written twice)
        # (nor where it reads tensors from outside: a write to them the probe does not see, a
        # functional batch norm's running statistics, would be made twice, and the replay's
        # outputs computed from it)
        replay = chain and not self.mutated and not graph_writes and not self.opaque \
            and not self._wrote_held() and not self.read_tensors()
        if rehearsed is not None and not shared:  # (to the later sizes of capture_sizes)
            lend(self, rehearsed)
        family = self.family
        if family is not None:  # this call's graph is the family's template: it stands
            family.verified = True
            family.guard, family.flags, family.pinned = guard, self.flags, entry.pinned
            family.held_storages = entry.held_storages
            family.grads_read = entry.grads_read
            family.sets = sets
        return Outcome(GRAPHED, self.result, entry=entry, guard=guard, replay=replay,
                       shared=shared, states=[obj for _, obj in self.states])

    def _sets(self, made: list, reads: dict) -> tuple:
        """Of the module attributes the capture's run set to the constant or object they held
        (``made``, as ``Recorder.sets``; a share_graph layer's: its template layer's constants,
        on its own modules), those the real call set to that too, as ``(weakref, name,
        value)``: a replay runs no Python, and the user may change one between calls (a flag
        reset), or another signature's call set its own value (``self.last_n = x.shape[0]``).
        A set only the capture's path makes is none of them.

        An object (no constant) is set again only where the run read it, that very object, as
        an attribute of its own of a module of the callable's tree (``reads``: the capture's;
        ``self.keep = self.value``), as a :class:`~._watch.From` of that attribute: the guard
        checks that read on every replay, and the object is not held. One from anywhere else
        (an argument, a cache, a global, a container's item) is not: eager may set another
        object there on a later call; nor under a shared cache policy (another module's call
        replays the graph)."""
        if not made:
            return ()
        real = {(id(m), n): v for m, n, _, v in self.recorder.writes}
        real.update(((id(m), n), v) for m, n, v in self.recorder.sets)
        tree = None
        sets = {}
        for module, name, value in made:
            key = (id(module), name)
            if key not in real or not _watch.same(real[key], value):
                continue
            if not is_constant(value):
                if tree is None:
                    tree = frozenset(map(id, self.statics.modules))
                value = None if self.state.policy.shared else _watch.From.find(value, reads, tree)
                if value is None:
                    continue
            sets[key] = (weakref.ref(module), name, value)
        return tuple(sets.values())

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

    def _guard(self, rec: Recorder, leave_out: set[tuple[int, str]] = frozenset(),
               loose=()) -> StateGuard:
        """What ``rec``'s run read, as a guard (less the attributes ``leave_out`` names; the
        layouts of the tensors on the storages ``loose`` names unchecked)."""
        root = self.statics.root
        modules = [weakref.ref(m) for m in self.statics.modules if m is not root]
        ran = [m for m in rec.called.values() if m is not root]
        # (a partial's bound arguments, a plain object's method or a callable object: what
        # it carries is read as a forward's mutable objects are)
        fn, carried, attrs = callable_state(self.user_fn)
        return StateGuard([r for key, r in rec.reads.items() if key not in leave_out],
                          hooks=lambda: _watch.hook_fingerprint(modules),
                          bindings=function_bindings(fn) + attrs, ran=ran,
                          objects=self.objects + carried,
                          owned=frozenset(map(id, self.statics.modules)), loose=loose,
                          tree=self.statics.modules)


def _leaf_label(sig: Signature, index: int) -> str:
    """How a message names the argument that leaf ``index`` belongs to."""
    specs, names = sig.spec[:2]
    nargs = len(specs) - len(names)
    start = 0
    for k, spec in enumerate(specs):
        if index < start + spec.num_leaves:
            return f"argument {names[k - nargs]!r}" if k >= nargs else f"argument {k}"
        start += spec.num_leaves
    return f"argument leaf {index}"


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
