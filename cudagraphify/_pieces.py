"""How a root's pieces run: the submodules a piecewise plan graphified (or a plan made around
an argument no signature can hold), part of every :class:`~._engine.GraphedState`.

- **Planning around an opaque argument** (``_plan_around``): an HF ``DynamicCache``'s first
  inference call runs under the probe once, and the submodules it leaves safe become pieces.
- **Chaining** (``chained``): a root's eager run calls its pieces inside an implicit region of
  its own (one pool; outputs handed on without copies, inputs read where they lie); what the
  root returns is copied off the pieces' memory. With segments on, the runs of safe calls of
  the forward are graphed instead (:mod:`._segrun`).
- **Paying** (see :mod:`._trial`): each piece's first calls time its graph against its eager
  run (``_judge``), then the plan as a whole against the forward with every piece plain
  (``_plan_timed``); a piece that does not pay is given back (``give_back``): its graphs are
  released and its plain forward put back in place (``retire``, set by :mod:`._wrap`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Callable, Iterator

import torch

from . import _capture, _guards, _region, _segrun, _trial, _watch
from ._capture import drain
from ._cache import EagerEntry
from ._errors import warn_once
from ._nested import Nested, Plain, in_graphed_call, nesting, plain_reason
from ._piecewise import PiecewiseEntry, new_probe, plan, probed
from ._probe import Finding
from ._signature import opaque_objects
from ._trial import PlanTrial
from ._training import TrainingGraph

__all__ = ["CHAIN_PIECES", "PLAN_PLAIN", "PieceRuns", "STATE"]

_region_stack = _region.stack_var()
_grad_enabled = torch.is_grad_enabled
# Pieces chain in their root's implicit region (see PieceRuns.chained); the bench turns this
# off to time what chaining buys, side by side.
CHAIN_PIECES = True
# why a piece ran plain in its root's plan trial (see _trial)
PLAN_PLAIN = "plan trial: the forward timed with every piece plain"
STATE = "_cudagraphify_state"  # a module's GraphedState, in its __dict__ (see _wrap)
# whether the pieces called now run in the first run with pieces of a root's keyed signature
# (a piecewise plan's entry): that root's first call of the signature ran them plain, a first
# sight of its own, so they capture at theirs (see _engine._SEEN_ONCE). In its later runs a
# piece's new signature is one the root's key does not fix (a shape that depends on the data:
# a boolean mask), and under a root run around an opaque argument (an HF DynamicCache), which
# has no signature, every new one is: they are seen first
keyed_root: contextvars.ContextVar[bool] = contextvars.ContextVar("cudagraphify_keyed_root",
                                                                  default=False)


def _run_stream(device) -> int | None:
    """The stream a run of a callable in its own region is on (see GraphRegion.enter_run), or
    None where there is none to know (no device yet; a CPU device under CUDA's backend)."""
    if device is None:
        return None
    backend = _capture.default_backend()
    if device.type != "cuda" and isinstance(backend, _capture.CudaBackend):
        return None
    return backend.stream_token(device)


@contextlib.contextmanager
def _receivers(probe, objects: list) -> Iterator[set[str]]:
    """While the block runs: the paths (``probe``'s names) of the submodules called with one
    of ``objects`` as an argument, on the probing thread (an HF decoder layer and its attention,
    passed the ``DynamicCache``): what they do with it, the probe need not see (its lazy
    set-up, its growth by ``torch.cat``)."""
    passed: set[str] = set()
    thread = threading.get_ident()

    def hook(module, args, kwargs, output):
        if threading.get_ident() == thread and any(
                x is o for o in objects for x in (*args, *kwargs.values())):
            name = probe.names.get(id(module))
            if name is not None:
                passed.add(name)

    with _watch.own_global_hook(torch.nn.modules.module.register_module_forward_hook, hook,
                                with_kwargs=True, always_call=True):
        yield passed


class PieceRuns:
    """The pieces part of :class:`~._engine.GraphedState` (its attributes are set there:
    ``pieces``, ``given_back``, ``retire``, ``_chain``, ``_plan_trial``...)."""

    def _plan_around(self, opaque: str, backend, fn: Callable, args: tuple,
                     kwargs: dict) -> Any:
        """The first inference call with an argument no signature can hold (an HF
        ``DynamicCache``, which ``generate()`` passes from its first call on): it runs eagerly,
        under the probe, once, and the submodules that the argument and the unsafe ops leave
        safe are graphed as the pieces of a piecewise plan are (a decoder layer's norms, MLP
        and projections around its attention over the growing cache). Each piece decides its
        own calls (its own probe, guards and timing)."""
        self._opaque_planned = True
        root = self.statics.root
        params = self.statics.tensors
        if root is None or self.install_pieces is None or not self.options.probe \
                or not params or not backend.supports(params[0].device):
            return self._eager(opaque, fn, args, kwargs)
        self.eager_calls[opaque] += 1  # (counted first, as _eager does: forward may raise)
        warn_once(self._warned, self.name, opaque)
        if self._device is None:  # (the device its segments, if on, are graphed on)
            self._device = params[0].device
            self.accel = frozenset({self._device.type})
        probe = new_probe(self)
        with Nested(), _receivers(probe, opaque_objects(
                args, kwargs, self.static_positions, self.static_names)) as passed:
            out = probed(probe, lambda: fn(*args, **kwargs))()
        findings: dict[str, list] = {"": [Finding("", opaque, ("OPAQUE",), "every call")]}
        for f in probe.findings:
            findings.setdefault(f.path, []).append(f)
        for path in sorted(passed - {""}):  # (their calls are opaque too: never a piece)
            findings.setdefault(path, []).append(Finding(path, opaque, ("OPAQUE",), "every call"))
        _, pieces = plan(root, findings, probe.ran())
        if pieces:
            self._add_pieces(self.install_pieces(pieces))
            self.last_plan = (findings, pieces)
        return out

    def _add_pieces(self, installed: list) -> None:
        new = [m for m in installed if all(m is not x for x in self.pieces)]
        self.pieces.extend(new)
        self._pieces_live = (-1, False)
        if new:  # (a plan with other pieces: judged again)
            self._plan_trial = None

    def _chain_needed(self) -> bool:
        """Whether this callable's eager runs still need their implicit region (see
        ``chained``): a piece of its plans may still replay a graph (not all of them were given
        back), or another graphed callable (one the user graphified, not a piece) has graphs
        in the region, whose outputs the region copies on the way out. Looked at again only
        when a piece anywhere was given back or a state was made (a piece ungraphified and
        graphified again is live)."""
        seen, live = self._pieces_live
        if seen != _trial.pieces_epoch[0]:
            seen = _trial.pieces_epoch[0]
            live = any(getattr(m.__dict__.get(STATE), "given_back", None) is None
                       for m in self.pieces) or (self._chain is not None and self._chain.in_use())
            self._pieces_live = (seen, live)
        return live

    def _judge(self, entry, out: Any, region) -> Any:
        """After a timed call of a piece's graph (see _trial): once timed enough, keep the
        graph, or give the piece back (it runs as plain PyTorch, its graphs released)."""
        trial = entry.trial
        if trial.done and not (type(entry) is TrainingGraph and entry.pending()):
            # (a training graph whose last replay's backward is still to run is judged on a
            # later call: its graph, discarded now, would be released under that backward)
            entry.trial = None
            why = trial.verdict()
            cache = region.cache_for(self) if region is not None else self.cache
            key = cache.key_of(entry)
            if why is None:
                pass
            elif any(k != key for k, _ in self._graph_items()):
                # other signatures have graphs (a prefill's and a decode step's): only this
                # one runs eagerly from now on
                drain(entry.device, self._stream_holder(region)._stream_token)
                self._retired_copies += entry.input_copies
                cache.discard(entry)
                cache.put(key, EagerEntry(why.replace("piece given back", "signature run "
                                                      "eagerly", 1), self, entry.state,
                                          entry.flags))
                self._fast = self._alt = None
            else:
                self.give_back(why)
        return out

    def give_back(self, why: str) -> None:
        """From now on this piece's calls run its plain forward (see _trial): its graphs are
        released, but for a training graph whose backward is still to run (kept until
        ``release``: autograd holds the call), and, with none left, what its statics hold.
        Then its plain forward is put back in place (``retire``): its later calls are plain
        PyTorch, not counted; ``eager_calls`` keeps the reason, with the calls counted before."""
        # (the reason shows in stats, counted or not; its key is made before another thread,
        # seeing given_back, counts it: a first count through Counter.__missing__ could be lost)
        self.eager_calls[why] += 0
        self.given_back = why
        _trial.pieces_epoch[0] += 1
        self._fast = self._alt = None
        self._release_given_back()
        for region in _region.all_open():
            if region.implicit:  # its graphs chained in a callable's region (see chained)
                region.forget(self)
        if not self._backward_pending:
            self._retire()

    def _retire(self) -> None:
        retire, self.retire = self.retire, None
        if retire is not None:
            retire()

    def _release_given_back(self) -> None:
        """Release a given-back piece's graphs but a training graph whose backward is still
        to run (released by a later call once it ran), and, with none left, let go of what its
        statics hold (parameters moved later must not be held here)."""
        self.release(keep=lambda g: type(g) is TrainingGraph and g.pending())
        self._backward_pending = bool(self.cache.graphs(self))
        if not self._backward_pending:
            self.statics.let_go()

    def _given_back(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """A call of a piece given back: its plain forward (counted, but inside another
        graph's warm-up or capture on this thread, whose ops these are)."""
        if self._backward_pending:
            with self.lock:
                self._release_given_back()
                if not self._backward_pending:
                    self._retire()
        if not (nesting[0] and in_graphed_call()) or plain_reason() is not None:
            self.eager_calls[self.given_back] += 1
        return fn(*args, **kwargs)

    def chained(self, fn: Callable, args: tuple, kwargs: dict, entry=None) -> Any:
        """:meth:`_chained`, with :data:`keyed_root` set for the pieces it calls."""
        first = type(entry) is PiecewiseEntry and not entry.chained_once
        if first:
            entry.chained_once = True
        elif not keyed_root.get():  # (as it is: the common case, no set and reset)
            return self._chained(fn, args, kwargs, entry)
        token = keyed_root.set(first)
        try:
            return self._chained(fn, args, kwargs, entry)
        finally:
            keyed_root.reset(token)

    def _chained(self, fn: Callable, args: tuple, kwargs: dict, entry=None) -> Any:
        """Run ``fn`` eagerly; where this callable graphed pieces (a piecewise plan, or pieces
        around an opaque argument), an inference call outside any region calls them inside an
        implicit region of its own: their graphs share one pool and chain as a
        ``graph_region``'s do (an output is handed on without a copy, a piece whose input is
        one reads it in place; an alias still held is moved to a copy before its memory is
        overwritten, or the call runs eagerly). The region lives as long as the plan. The
        outputs returned to the caller are copies where they lie on a piece's memory (the
        caller may share them where use counts do not see: DLPack, CuPy; or resize them).

        With segments on (the ``segments`` option, or ``_segrun.ENABLED``), an inference call of
        a piecewise ``entry`` (or one with an opaque argument) outside any region runs its
        forward with the runs of safe calls graphed instead (:class:`~._segrun.Segments`; its
        pieces then run as part of it), once timed against the forward without them where the
        backend has a clock (see _trial).

        Without segments, once the pieces settled, the plan is timed the same way against the
        forward with every piece run plain (:class:`~._trial.PlanTrial`), where the backend
        has a clock; where it is not faster, every piece is given back."""
        if _grad_enabled():  # (every branch below runs a grad-mode call plain: asked first)
            return fn(*args, **kwargs)
        if _capture.default_backend().in_capture():
            # inside a capture of the caller's (reached through an eager fast path, which does
            # not ask): part of it, plain, as the slow path decides; its stream is none of the
            # implicit region's (another thread's replay waiting on it would join the capture,
            # and it may not wait on work outside it)
            return fn(*args, **kwargs)
        if entry is not None and (self.options.segments or _segrun.ENABLED) \
                and self._device is not None and _guards.dual_level() < 0 \
                and self.share is None and not torch.is_grad_enabled() \
                and not _region_stack.get():
            # (without segments: this method without an entry)
            return self.segments.call(entry, _capture.default_backend(), fn, args, kwargs,
                                      self.chained)
        if not self.pieces or _region_stack.get() or torch.is_grad_enabled() \
                or self.share is not None or not CHAIN_PIECES or not self._chain_needed():
            # (share_graph layers share outside regions; pieces all given back run as plain
            # PyTorch: nothing to chain, unless other graphed callables have graphs in it)
            return fn(*args, **kwargs)
        trial = self._plan_trial
        if trial is not False and _trial.PLAN_TRIAL and not (self.options.segments
                                                             or _segrun.ENABLED):
            # (with segments on, their own trial times them against this forward)
            backend = _capture.default_backend()
            clock = getattr(backend, "clock", None)
            params = self.statics.tensors
            # (not inside a capture of the caller's: no synchronisation there, and its pieces
            # run plain, as part of it)
            if clock is not None and params and not backend.in_capture():
                if trial is None:
                    trial = self._plan_trial = PlanTrial(clock(params[0].device))
                return self._plan_timed(trial, fn, args, kwargs)
        return self._chain_run(fn, args, kwargs)

    def _chain_run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        chain = self._chain
        if chain is None:
            chain = self._chain = _region.GraphRegion()
            chain.implicit = True
            _region.register(chain)  # (an invalidated piece forgets its graphs in it)
        stream = _run_stream(self._device)
        if stream is not None:
            with chain.lock:  # (a replay under way reads and sets the region's last stream)
                chain.enter_run(stream)
        token = _region_stack.set((chain,))
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            _region_stack.reset(token)
            with chain.lock:
                chain.release_aliases()
                if stream is not None:
                    chain.exit_run(stream, _capture.default_backend(), self._device)
            raise
        _region_stack.reset(token)
        with chain.lock:
            # what goes back to the caller is theirs: copies, not the pieces' aliases; and no
            # alias handed out in this run outlives it (see GraphRegion.release_aliases)
            mine = chain.owned_outputs(out)
            del out
            # (an alias returned and also kept elsewhere: the caller's is that alias, moved)
            mine = chain.release_aliases(mine)
            if stream is not None:
                chain.exit_run(stream, _capture.default_backend(), self._device)
        return mine

    def _plan_timed(self, trial: PlanTrial, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """A forward while the plan's trial runs (see _trial): as planned, or plain (every
        piece runs its plain forward, as inside a capture); once both are timed enough, the
        verdict: where the plan is not faster, every piece of it is given back."""
        # (one trial, one kind of call: with the first tensor argument of the first one timed,
        # its shape and dtype; a prefill among decode steps runs as planned, untimed; the
        # other tensors may grow, as a decode step's attention mask does)
        key = next(((a.shape, a.dtype) for a in (*args, *kwargs.values())
                    if isinstance(a, torch.Tensor)), ())
        if trial.key is None:
            trial.key = key
        elif key != trial.key:
            return self._chain_run(fn, args, kwargs)
        if trial.plain_next():
            def run():
                with Plain(PLAN_PLAIN):
                    return fn(*args, **kwargs)
            out = trial.timed(run, True)
        else:
            out = trial.timed(lambda: self._chain_run(fn, args, kwargs), False)
        if trial.done:
            self._plan_trial = False
            self.plan_verdict = trial.summary()
            why = trial.verdict()
            if why is not None:
                for m in self.pieces:
                    st = m.__dict__.get(STATE)
                    if st is not None and st.given_back is None:
                        with st.lock:
                            st.give_back(why)
        return out
