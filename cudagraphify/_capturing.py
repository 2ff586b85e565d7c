"""A signature's first call, phase 3 (see :mod:`._first_call`): the capture. The extra warm-ups
(on copies of the inputs, their writes undone), then the capture itself, under the probe and
the recorder again: an inference graph (``_capture_inference``: into the callable's pool or the
region's, a share_graph layer's graph made from its group's template, an HF static cache's from
its family's) or a training graph (forward and backward)."""

from __future__ import annotations

import contextlib
import threading
import traceback
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from . import _cugraph, _watch, _writes
from ._capture import _first_line, collect_young
from ._errors import CaptureFailed
from ._nested import Nested
from ._outcome import DEFERRED, PIECEWISE, Outcome
from ._piecewise import new_probe, probed, write_tracker
from ._probe import Finding
from ._rehearsal import mark, rehearsing
from ._replay import (CapturedGraph, OutputPlanError, StaticInputs, clone_output, plan_outputs,
                      static_output)
from ._graphdiff import Storages
from ._signature import is_constant, storage_of, unflatten_call
from ._state import tensors_in as _tensors_in
from ._training import capture_training
from ._warmups import _name_of, extra_warmups, version_of
from ._watch import Recorder, recording


_SWAPS = ("forward swaps tensors (torch.utils.swap_tensors) on the runs beyond its first: a "
          "graph made from the template would not")


class Capturing:
    """Phase 3 of :class:`~._first_call.FirstCall` (its attributes are set there)."""

    def capture(self) -> Outcome:
        # (the tensors the forward reads from outside, plain attributes, closures, globals,
        # hold afterwards what the real call left in them, values and versions: a capture's
        # in-place ops move their versions, and its run is real for CPU tensors (a step
        # counter) and for the kernels a share_graph or family proof runs; the parameters and
        # buffers keep their layouts and versions too, those it did not write included (a
        # later path's write, ``self.log.set_(...)``), their values being put back by the
        # extra warm-ups, which put back these tensors too)
        try:
            return self._capture_kept()
        finally:
            self._count_borrowed()

    def _capture_kept(self) -> Outcome:
        with contextlib.ExitStack() as kept:
            try:
                # (where the capture's run is real only for the host: the CPU tensors' bytes;
                # the layouts and versions of all)
                kept.enter_context(_writes.kept(self._left(), self.held_tensors(),
                                                host_only=not self._runs_kernels()))
            except torch.OutOfMemoryError as e:  # (their copies: the real call's result stands)
                _forget_frames(e)
                return Outcome(DEFERRED, self.result, reason=(
                    "capture deferred (retried on a later call): out of memory copying the "
                    "tensors the forward reads from outside its arguments, parameters and "
                    f"buffers: {_first_line(e)}"), guard=self.warm_guard)
            kept.enter_context(_writes.layouts_kept(self.statics.tensors))
            # (and the versions of other tensors from before the call its ops write, a global
            # only a later path writes, and where the capture runs the host's work for real, the
            # bytes of the host's: see ``_capture``, after ``verify`` read them)
            # (the layouts of those its ops take: a global's ``set_``, put back after the
            # versions, which it moves)
            self.run_layouts = {}
            kept.callback(_writes.put_seen_back, self.run_layouts)
            self.run_versions = {}
            kept.callback(_writes.put_versions_back, self.run_versions)
            self.run_saved = dict.fromkeys(self.kept_storages())
            kept.callback(_writes.put_storages_back, self.run_saved)
            return self._capture()

    def _count_borrowed(self) -> None:
        """After a capture that read slots of its region in place (``borrow_counts``, see
        ``_capture_inference``): the references to each slot's memory that the new graph holds
        (outputs that are views of it) count as cudagraphify's own, not as an alias held.
        Counted once what the capture's run noted is let go: its probe keeps the tensors whose
        layouts it saw taken (``run_layouts``: views the forward made of the slot, as a rotary
        embedding's halves), and counted as the graph's they would leave the slot's alias
        unprotected once they are gone."""
        for noted in (self.run_layouts, self.run_versions, self.run_saved):
            noted.clear()  # (put back by now; cleared in place: the probe holds them too)
        pending, self.borrow_counts = self.borrow_counts, []
        if pending:
            # (a reference cycle the capture's run made, a view of the slot in a closure or a
            # caught exception's frames, is garbage the collector frees later: a capture on
            # CUDA runs with the collector off)
            collect_young()
        for cells, region, entered in pending:
            # (a run of the callable that began on another thread during this capture may
            # have made views of a borrowed slot meanwhile: its references are not told from
            # this graph's, so none is counted as this graph's own: the slot is then protected
            # more often than needed, never less)
            counted = region.entered == entered and not _another_runs(region)
            for cell in cells:
                slot, held, _ = cell
                n = slot.users() - held if counted else 0
                slot.own_more(n)
                cell[2] = n

    def _capture(self) -> Outcome:
        failed: CaptureFailed | None = None
        try:
            unseen = extra_warmups(self)
        except Exception as e:  # noqa: BLE001 - the real call succeeded: its result stands
            _forget_frames(e)
            failed = CaptureFailed(f"extra warm-up failed: {_first_line(e)}",
                                   transient=isinstance(e, torch.OutOfMemoryError))
        else:
            if unseen:  # (a write no copy could undo: no graph made on top of it)
                return self._eager(unseen)
        second = new_probe(self.state, thunder=False)
        if second is not None:
            second.known = set()  # track what the capture's ops produce (see verify)
            second.written = set()  # and what they write (verify: held_storages)
            second.locate = False  # (what it reads from outside is the warm-up's business)
            second.versions = self.run_versions  # (put back: see ``capture``)
            second.layouts = self.run_layouts
            if not getattr(self.backend, "capture_runs_kernels", True):
                second.saved, second.host_only = self.run_saved, True
        rec = Recorder()
        try:
            if failed is not None:
                raise failed
            run = self._counting_versions(probed(second, self.fn))
            self.capture_versions = [version_of(t) for t in self.watchable]
            with Nested(), recording(rec):
                if self.training:
                    entry = capture_training(
                        self.backend, run, self.sig, self.leaves, self.static_flags,
                        self.statics.grad_params(), self.device, self._persistent(),
                        self.statics.stand_ins, self.saved, self._watch_backward(second))
                else:
                    entry = self._capture_inference(run)
                    entry.scratch = _scratch(entry, second)
        except (CaptureFailed, torch.OutOfMemoryError) as e:
            _forget_frames(e)
            self._put_back(rec)  # (the capture's run is not a call, as in ``verify``)
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
            self._put_back(rec)  # (the capture's run is not a call)
            return self._eager(str(e))
        if self.backward_wrote:
            entry.release()
            self._put_back(rec)
            return self._eager_or_piecewise([Finding("", "backward", ("PYTHON_HOOK",),
                                                     self._backward_writes())])
        return self.verify(entry, second, rec)

    def _watch_backward(self, second):
        """What the capture's backward runs (see ``capture_training``'s ``watch``): under a
        probe of what its Python writes in memory from before the call (a tensor hook the
        forward registered, an autograd Function's backward), whose versions, and where the
        capture runs the host's work for real the host's bytes, are put back as the forward's
        (see ``capture``); the storages it wrote are ``backward_wrote``. None where the probe
        is off (``second``: the forward's, whose memory is the run's own)."""
        if second is None:
            return None

        def watch(backward, made):
            known = set(second.produced) | {storage_of(t) for t in made}
            tracker = write_tracker(self.state, known, None, self.run_versions,
                                    self.statics.weight_ptrs(), self.run_layouts)
            if second.host_only:
                tracker.saved, tracker.host_only = self.run_saved, True

            def run():
                try:
                    with tracker:
                        return backward()
                finally:
                    self.backward_wrote = tracker.written_before_made - known
            return run
        return watch

    def _backward_writes(self) -> str:
        """Why a graph of this signature is refused where the capture's backward wrote memory
        from before the call (``backward_wrote``): the graph would replay the device's part of
        the write only, with no version counter moved."""
        wrote = self.backward_wrote
        what = next((_name_of(self, t) for t in self.statics.tensors
                     if storage_of(t) in wrote), None)
        if what is None:
            t = next((t for t, _ in self.run_versions.values() if storage_of(t) in wrote), None)
            what = "memory from before the call" if t is None else \
                f"a {tuple(t.shape)} tensor that is no parameter or buffer (a plain " \
                "attribute, a global)"
        return ("Python the backward runs (a tensor hook the forward registers, an autograd "
                f"Function's backward) writes {what} in place: a replay of the backward graph "
                "runs no Python (a host tensor's write would be lost) and moves no version "
                "counter")

    def _counting_versions(self, run: Callable) -> Callable:
        """``run`` (the capture's run of a forward) noting how far it moves the version
        counters of the parameters and buffers (``version_moves``): the graph's replay moves
        them as much (see _versions), as the in-place ops it runs would eagerly (BatchNorm's
        running statistics by none). The capture's run, not the real call's: a write only a
        first call makes (behind a Python flag) is not replayed."""
        # (and the tensors it reads from outside, plain attributes: autograd may save them too)
        watch = list({id(t): t for t in (*self.statics.watchable()[0],
                                         *self.held_tensors())}.values())

        def counted(*args, **kwargs):
            before = [version_of(t) for t in watch]
            try:
                return run(*args, **kwargs)
            finally:
                self.version_moves = [(t, t._version - v) for t, v in zip(watch, before)
                                      if v is not None and t._version > v]
        return counted

    def graph_writes(self, second) -> list[int]:
        """The parameters and buffers (indices into ``watchable``) the capture's run wrote,
        those the real call wrote among them or not (a later path's write, ``out=self.tmp``):
        by their versions, and as its probe (``second``) saw. A replay writes them."""
        written = second.written if second is not None and second.written is not None else ()
        return sorted(set(self.wrote_statics) | {
            j for j, (t, v) in enumerate(zip(self.watchable, self.capture_versions))
            if (v is not None and version_of(t) != v) or storage_of(t) in written})

    def kept_storages(self) -> set[int]:
        """The storages whose bytes ``_writes.kept`` puts back around the runs that are not
        calls (those of the tensors the forward reads from outside or bound to attributes; a
        buffer one of them views is not among them: a probe copies it where it is written)."""
        held = (*self.held_tensors(), *(t for v in self._left() for t in _tensors_in(v)))
        return {storage_of(t) for t in held} - self.static_storages

    def _left(self) -> list:
        """The objects the real call bound to module attributes (``self.ring =
        torch.roll(...)``): runs that are not calls may write them in place."""
        return [new for _, _, _, new in self.recorder.writes]

    def _put_back(self, rec: Recorder) -> None:
        """After runs that were not calls (extra warm-ups, the capture's, a rehearsal): the
        module attributes they set (``rec``), and what the containers, objects and closure
        cells the forward reads hold, are what the real call left."""
        rec.undo()
        self.warm_guard.restore()
        if self.states_guard is not None:
            self.states_guard.restore()

    def _runs_kernels(self) -> bool:
        """Whether the capture's run may run kernels for real: where a capture runs none
        (CUDA) only the host's tensors are written by it, unless a share_graph group or a
        static-state family checks its graph by running kernels. (Copying the device's would
        cost a second copy of a large cache or table, and nothing.)"""
        return getattr(self.backend, "capture_runs_kernels", True) \
            or self.state.share is not None or bool(self.sig.static_states)

    def _persistent(self) -> set[int]:
        """Storages the caller owns (parameters, buffers, tensors kept as module attributes):
        returned as they are, never treated as a graph's output slots."""
        return self.static_storages | {storage_of(t) for t in self.warm_guard.tensors}

    def _wrote_held(self, made_ok: bool = False) -> bool:
        """Whether the real call may have written a tensor it reads from outside, or one it
        bound to a module attribute (with ``made_ok``, share_graph's check, only one it did not
        make itself, ``self.acc = pool.pop()``: a layer's own activation kept as
        ``self.sample = h`` does not count): as its probe saw, or any such tensor where no
        probe looked. (A write the probe does not see, a functional batch norm's running
        statistics, is not found: README, share_graph.)"""
        read, bound = self.read_tensors(), self._bound_tensors()
        probe = self.warm_probe
        if probe is None or probe.written is None:
            return bool(read or bound)
        written = probe.written_before_made if made_ok else probe.written
        return any(storage_of(t) in probe.written for t in read) \
            or any(storage_of(t) in written for t in bound)

    def read_tensors(self) -> list[torch.Tensor]:
        """The tensors the real call read from outside its arguments, parameters and buffers
        (plain tensor attributes, closures, globals: the warm-up's guard holds them): a graph
        reads them in place."""
        statics = self.static_storages
        return [t for t in self.warm_guard.tensors if storage_of(t) not in statics]

    def _bound_tensors(self) -> list[torch.Tensor]:
        """The tensors in the objects the real call bound to module attributes, but those it
        read and the statics."""
        statics = self.static_storages
        read = {id(t) for t in self.warm_guard.tensors}
        return [t for t in {id(t): t for v in self._left() for t in _tensors_in(v)}.values()
                if id(t) not in read and storage_of(t) not in statics]

    def held_tensors(self) -> list[torch.Tensor]:
        """What the runs that are not calls may write in place and must leave as the real call
        did: the tensors it read from outside (:meth:`read_tensors`) and those it bound to
        module attributes. All of them, not only those the probe saw written: a functional
        batch norm updates running statistics kept there through no op the probe knows as a
        write (copied around the capture, its extra warm-ups included, and a rehearsal: a
        function keeping large tensors there pays their size)."""
        return self.read_tensors() + self._bound_tensors()

    def _capture_inference(self, fn: Callable) -> CapturedGraph:
        region, leaves, state = self.region, self.leaves, self.state
        chain = region is not None and region.chain
        mutated = self.mutated
        borrow = region.borrowable(leaves) if chain else {}
        borrow = {i: s for i, s in borrow.items() if not self.static_flags[i] and i not in mutated}
        if borrow and _another_runs(region):
            # Another thread runs the callable whose region this is: its code may make views of
            # those slots' memory (``q.view(...)`` of an alias it holds) while this capture
            # runs, which the use counts taken around it (``own_more`` below) would count as
            # this graph's own references, and the slot's alias would then go unprotected
            # (review finding FP-1). Its inputs are copied in instead.
            borrow = {}
        inputs = StaticInputs(leaves, self.static_flags, {i: s.tensor for i, s in borrow.items()})
        mark(self, inputs)  # (where it may confirm a lent rehearsal: what it writes)
        entered = region.entered if borrow else 0
        if borrow:
            collect_young()  # (the garbage of the runs before: not alive at the count either)
        # (slot, its use count now, the references counted as this graph's: see
        # _count_borrowed)
        cells = [[slot, slot.users(), 0] for slot in borrow.values()]
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
        # (a graph of its own, captured here: what its capture allocated and freed; a
        # template's: unknown)
        counts = (getattr(raw, "allocs", None), getattr(raw, "frees", None)) if made is None \
            else (None, None)
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
        entry.allocs, entry.frees = counts
        entry.borrowed = list(borrow.items())
        # (a slot it reads in place whose memory the caller grows moves away from where this
        # graph reads: checked as its own outputs handed out are, see ``handed_moved``)
        entry.handed += [(slot.tensor, slot.ptr) for slot in borrow.values()]
        if mutated and not chain and not copy_outputs:
            # The caller holds the graph's own outputs: one passed back as an input the forward
            # writes would be overwritten by the copy-back after the replay.
            entry.hazard = {storage_of(t) for t in _tensors_in(out)} - {0}
        if forget is not None:
            entry.on_release.append(forget)
            entry.after_release.append(refit)
        if cells:
            # outputs that are views of a borrowed input are cudagraphify's own references:
            # counted once the capture's bookkeeping is let go (_count_borrowed), and no
            # longer once the graph is released (before that count: none is made)
            self.borrow_counts.append((cells, region, entered))
            entry.on_release.append(lambda: _disown(cells))
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
        part = None
        if self.opaque:
            # a cache passed as it is (an HF StaticCache): each layer's graph reads and writes
            # its own part of it, rebased as its parameters are
            part = self._cache_part()
            if isinstance(part, str):
                group.refuse(part)
                return None
        if self.mutated or self.wrote_statics or self._wrote_held(made_ok=True):
            # Sharing replays graphs to check them (and runs a second layer once): each replay
            # would apply the forward's writes (running statistics, a cache, a counter kept as
            # a plain tensor attribute) once more.
            group.refuse("forward writes to its buffers or inputs" if self.mutated
                         or self.wrote_statics else "forward writes a tensor it reads from "
                         "outside (a plain tensor attribute, a closure, a global)")
            return None
        if not getattr(self.backend, "can_share", False):
            group.refuse("the capture backend cannot read graphs")
            return None
        if group.swaps or self.later_hooks.swaps_seen():
            group.refuse(_SWAPS)
            return None
        unset = self._sets_not_the_templates(group, k)
        if unset is not None:
            group.refuse(unset)
            return None
        made = group.make(k, self.key, fn, a, kw, inputs, self.leaves, self.backend,
                          self.device, self.result, self.warm_guard, part)
        if self.later_hooks.swaps_seen():
            # (the template's runs swapped tensors: so would every layer's call, a graph made
            # from it would not; no layer of the group shares from now on)
            group.swaps = True
            group.refuse(_SWAPS)
            return None
        if made is not None:  # (what its replay sets again: its template layer's, see verify)
            self.shared_sets = group.layer_sets(k, self.key)
        return made

    def _sets_not_the_templates(self, group, k: int) -> str | None:
        """Why layer ``k`` may not replay its group's template for this key: its real call set
        a module attribute the template layer's capture did not set again to the same constant
        (a flag only some layers set, an object: a replay of the template's graph sets only the
        template's, see ``ShareGroup.layer_sets``); None where it set none such, or where there
        is no template yet (this layer's capture would be it)."""
        template = group._templates.get(self.key)
        if template is None:
            return None
        paths = {id(m): p for p, m in group.layers[k].named_modules()}
        tree = frozenset(paths)
        rec = self.recorder
        own = {(paths.get(id(m)), n): v for m, n, v in rec.sets}
        own.update(((paths.get(id(m)), n), v) for m, n, _, v in rec.writes)
        theirs = {(p, n): v for p, n, v in template.sets}
        for (path, name), value in own.items():
            if path is None:
                continue  # (a module outside the layer: not the group's to set)
            if not is_constant(value) and _watch.From.find(value, rec.reads, tree) is None:
                continue  # (an object no graph sets again, its own either: see _first_call)
            if (path, name) not in theirs or not _watch.same(theirs[path, name], value):
                return (f"the layer's forward sets {name!r} (at {path or 'the layer'}) where its "
                        "template layer's does not set it the same: a replay of the template's "
                        "graph would not set it")
        return None

    def _cache_part(self):
        """This layer's part of the static states it is passed (see :class:`_share.Slice`):
        the state tensors its probed warm-up read or wrote. Or why there is none to share."""
        from ._share import Slice, _ranges

        if self.sig.static_objects:
            return ("an argument is passed as it is (static_argnames): sharing would run the "
                    "layers' forwards on it again")
        warm = self.warm_probe
        if warm is None or warm.written is None:
            return ("the probe is off (probe=False): which part of the cache a layer uses is "
                    "unknown")
        if self.probe is not warm:
            return "the layer asks whether it is being captured: not shared with a cache"
        if self.draws:
            return ("random ops (dropout in train mode): one shared graph cannot draw fresh "
                    "numbers per layer")
        if self.states_before is None:
            return ("the cache could not be copied as the call found it (too large for the "
                    "free memory): a layer's graph could not be checked")
        idx = self.sig.static_states
        objects = [self.leaves[i] for i in idx]
        every = [t for obj in objects for t in _tensors_in(obj)]
        before = [t for i in idx for t in _tensors_in(self.states_before[i])]
        if len({id(t) for t in every}) != len(every) or len(before) != len(every) or \
                len({p for p, _ in _ranges(every)}) != len(every):
            return "the cache holds one tensor twice, or tensors that share memory (views)"
        why = self._writes_besides(Storages(_ranges(every)))
        if why:
            return why
        touched = set(warm.outside) | warm.written
        positions = tuple(j for j, t in enumerate(every) if storage_of(t) in touched)
        if not positions:
            return "the layer uses no tensor of the cache it is passed"
        sig = self.sig
        state = self.state

        def call_on(leaves, objs):
            leaves = list(leaves)
            for i, obj in zip(idx, objs):
                leaves[i] = obj
            return unflatten_call(leaves, sig)

        def probe():
            p = new_probe(state, thunder=False)
            p.known, p.written, p.locate = set(), set(), False
            return p

        return Slice([every[j] for j in positions], [before[j] for j in positions], positions,
                     every, objects, call_on, probe)

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
        try:
            raw, out = backend.capture(lambda: fn(*a, **kw), self.device, pool=family.pool,
                                       keep_graph=True)
        except CaptureFailed:
            if getattr(family.pool, "retired", False):  # (no capture goes there again)
                family.refuse("a capture into its pool failed part way", final=True)
            raise
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


def _forget_frames(error: BaseException) -> None:
    """Clear the locals of a failed capture's frames: a traceback cycle would keep its tensors
    (and their autograd graph, which blocks the next capture) alive until the GC runs."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _scratch(entry, probe) -> bool:
    """Whether ``entry``'s replays may write memory of its pool other than its outputs (see
    ``CapturedGraph.scratch``): unless its capture freed no block on the device (no temporary
    of its forward or scratch of its kernels was given back to the pool while it ran), handed
    out as many as the storages its forward's ops made (as its probe saw: none made where no
    probe looks, inside an op, by a stream's first workspace), and each of those is one of its
    outputs (none freed after the capture either, to be handed to a later one)."""
    if entry.frees != 0 or probe is None or probe.produced is None \
            or entry.allocs != len(probe.produced):
        return True
    outputs = {storage_of(t) for t in entry.output_tensors()}
    return not probe.produced <= outputs


def _disown(cells: list) -> None:
    """A graph that read slots in place is released: the references counted as its own
    (``_count_borrowed``) are no longer; a count still to come finds none to make."""
    for cell in cells:
        cell[0].own_more(-cell[2])
        cell[2] = 0
    cells.clear()


def _another_runs(region) -> bool:
    """Whether a thread other than this one runs the callable whose region this is (see
    ``GraphRegion.enter_run``)."""
    me = threading.get_ident()
    return any(t != me for t in tuple(region.streams))
