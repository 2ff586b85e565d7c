"""share_graph: capture a block once, replay it for every identical layer with its own weights.

For one input signature, the first layer called is captured (the template), then a second
layer on the same static inputs (and, when their diff needs it, the first layer once more). Diffing the two graphs node by node tells which 8-byte argument
slots hold an address inside the layer's own parameters and buffers (the same storage and offset
in both layers); every other difference must be capture-dependent (two addresses of memory the
captures allocated, or bytes that also differ between the two captures of the first layer), and
the template's values stand for it. Anything else (another
kernel, another launch shape, a scalar that differs, an address of other memory) refuses
sharing. Each layer then gets the template instantiated, with those slots rebased to its own
storages in the executable graph, and checked once against the layer's eager output of that
call. All layers read the template's static inputs and write its outputs and intermediates: graph memory
does not grow with depth, and no weight is copied.

Where sharing is refused or unsupported (training, inside a ``graph_region``, random ops), each
layer captures its own graph in the group's one memory pool, and the reason is recorded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import torch
from torch.nn.parameter import is_lazy
import torch.utils._pytree as pytree

from ._errors import CaptureFailed, CudagraphifyError, CudagraphifyUsageError
from ._graphdiff import (RebasePlan, Refused, RetargetedRaw, Storages,  # noqa: F401
                         host_ranges, memory_ranges, plan_rebase, readable_ranges)
from ._options import Stats
from ._signature import is_constant, storage_of
from ._state import tensors_in as _tensors_in
from ._wrap import SHARE, share_of, state_of_module, uninstall_instance
from . import _watch, _writes

__all__ = ["ShareGroup", "first_difference", "plan_rebase", "Refused", "Storages"]

_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "training", "_cudagraphify_state",
               SHARE, "forward", "_forward_hooks", "_forward_pre_hooks",
               "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
               "_state_dict_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
               "_non_persistent_buffers_set", "_is_full_backward_hook"}


class _TensorLayout(NamedTuple):
    """What must agree between two layers' parameters (or buffers) of one name."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    device: torch.device
    requires_grad: bool
    storage_offset: int
    storage_bytes: int


def _describe(t: torch.Tensor | None) -> _TensorLayout | None:
    if t is None:
        return None
    if is_lazy(t):  # (a lazy module's, not initialized: no shape yet; its calls run eagerly)
        return _TensorLayout(("uninitialized",), t.dtype, (), t.device, t.requires_grad, 0, 0)
    return _TensorLayout(tuple(t.shape), t.dtype, t.stride(), t.device, t.requires_grad,
                         t.storage_offset(), t.untyped_storage().nbytes())


def _layout_difference(x: _TensorLayout | None, y: _TensorLayout | None) -> str:
    """The fields in which two layouts differ, named: ``dtype torch.float32 vs torch.float16``."""
    if x is None or y is None:
        return f"{'None' if x is None else 'a tensor'} vs {'None' if y is None else 'a tensor'}"
    return ", ".join(f"{name.replace('_', ' ')} {a} vs {b}"
                     for name, a, b in zip(x._fields, x, y) if a != b)


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)) or (
        isinstance(v, tuple) and all(_plain(x) for x in v))


def first_difference(a: torch.nn.Module, b: torch.nn.Module,
                     ignore: Iterable[str] = (), attrs: bool = True) -> str | None:
    """The first structural difference between two layers, in words (None if identical).

    Compared: classes and submodule names, ``training``, every parameter and buffer's shape,
    dtype, stride, device, requires_grad and storage layout, and (``attrs``) plain attributes
    (numbers, strings, dtypes, tuples of them) except those named in ``ignore``
    (``"self_attn.layer_idx"`` or a bare attribute name). Other attribute types cannot be
    compared and are not.
    """
    ignore = set(ignore)
    if type(a) is not type(b):
        return f"class {type(a).__name__} vs {type(b).__name__}"
    ma, mb = dict(a.named_modules()), dict(b.named_modules())
    if list(ma) != list(mb):
        extra = [n for n in ma if n not in mb] + [n for n in mb if n not in ma]
        return f"submodules differ ({', '.join(extra[:3]) or 'order'})"
    for name, sa in ma.items():
        sb = mb[name]
        where = name or "the layer"
        if type(sa) is not type(sb):
            return f"{where}: class {type(sa).__name__} vs {type(sb).__name__}"
        if sa.training != sb.training:
            return f"{where}: training={sa.training} vs {sb.training}"
        for kind in ("_parameters", "_buffers"):
            da, db = sa.__dict__[kind], sb.__dict__[kind]
            if list(da) != list(db):
                return f"{where}: {kind[1:]} {list(da)} vs {list(db)}"
            for n in da:
                x, y = _describe(da[n]), _describe(db[n])
                if x != y:
                    return f"{name + '.' if name else ''}{n}: {_layout_difference(x, y)}"
        for attr, va in sa.__dict__.items():
            if attr in _SKIP_ATTRS or attr in ignore or f"{name}.{attr}" in ignore:
                continue
            vb = sb.__dict__.get(attr, _Missing)
            if vb is _Missing:
                return f"{where}: attribute {attr} only on the first layer"
            if attrs and _plain(va) and _plain(vb) and va != vb:
                path = f"{name}.{attr}" if name else attr
                return f"{path}: {va!r} vs {vb!r}"
    return None


class _Missing:
    pass


@dataclass
class _Template:
    raw: Any  # the RawGraph of the first capture (owned here: every layer's graph reads its memory)
    layer: int
    nodes: list
    plan: RebasePlan | None
    storages: Storages
    layout: list  # the template layer's parameter/buffer descriptions
    inputs: Any  # StaticInputs shared by every layer
    out: Any
    reason: str | None = None  # why sharing was refused for this signature
    reads: dict = field(default_factory=dict)  # what the template layer's forward read
    edges: Any = None
    again: list | None = None  # a second capture of the template layer (padding bytes)
    call: tuple = ((), {})  # the template's capture arguments (on ``inputs``): for proofs
    guard: Any = None  # what the template layer's first call read (a StateGuard): while valid
    positions: tuple | None = None  # with a cache: where its part lies among the cache's tensors
    cache: Any = None  # with a cache: a weak reference to it (None: none, or not weakly held)
    users: int = 0  # layers' graphs made from it and not yet released (they read its memory)
    # module attributes its capture's run set to the constant they held, as (path inside the
    # layer, name, value): a layer's replay sets its own again (see ``layer_sets``)
    sets: tuple = ()

    def dead(self) -> bool:
        """Whether the cache it was made for is gone (no call can pass it again)."""
        return self.cache is not None and self.cache() is None


@dataclass
class Slice:
    """A layer's part of the static states its call is passed (an HF ``StaticCache``): the
    state tensors its warm-up read or wrote (its layer's keys and values), in the order
    :func:`~._state.tensors_in` walks the states. A layer's graph made from the template
    reads and writes its own part, rebased as its parameters are.

    Made by the engine (:meth:`~._capturing.Capturing._shared`) from the layer's probed
    warm-up. ``before``: copies of ``tensors`` as the call found them (its graph is checked by
    a replay from there); ``every``: every tensor of the states; ``call_on(leaves, objects)``:
    the call's (args, kwargs) from static-input ``leaves`` with ``objects`` as the states;
    ``new_probe()``: a probe that notes what a run reads and writes (another layer's part)."""

    tensors: list
    before: list
    positions: tuple
    every: list
    objects: list
    call_on: Any
    new_probe: Any


def _ranges(tensors) -> tuple:
    return tuple((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                 for t in tensors)


def _part_layout(tensors) -> list:
    return [_describe(t) for t in tensors]


@contextlib.contextmanager
def _bytes_kept(tensors: list):
    """Inside, ``tensors`` may be written (a replay, a capture's run on the CPU, a proof);
    afterwards they hold what they held before (as the real call left a cache). Yields their
    copies, by ``id`` of the tensor. A run inside that swapped a kept tensor's contents
    (``torch.utils.swap_tensors``) is swapped back first: the bytes go back into the contents
    the caller's object holds, not into what the run swapped in."""
    tensors = list({id(t): t for t in tensors}.values())
    with torch.no_grad():
        saved = {id(t): t.clone() for t in tensors}
    try:
        yield saved  # (by id of the tensor)
    finally:
        _writes.unswap()
        with torch.no_grad():
            for t in tensors:
                t.copy_(saved[id(t)])


class ShareGroup:
    """Layers that share captures; made by :func:`cudagraphify.share_graph`."""

    def __init__(self, layers: list[torch.nn.Module], ignore_attrs: tuple[str, ...] = (),
                 strict: bool = True, max_templates: int = 16):
        self.layers = layers
        self.ignore_attrs = ignore_attrs
        self.strict = strict
        self.max_templates = max_templates
        # One lock for the group and its layers' calls: they share static buffers.
        self.lock = self._lock = threading.RLock()
        self._stream_token: int | None = None  # the stream that replayed last (engine's)
        self._templates: dict[Any, _Template] = {}
        self._stale: list[_Template] = []  # replaced templates, kept until release
        self._pools: dict[int, Any] = {}
        # a layer's runs beyond its real call swapped tensors (torch.utils.swap_tensors): no
        # layer shares (see Capturing._shared)
        self.swaps = False
        self.captures = 0  # real captures (templates, and the second capture of each diff)
        self.retargets = 0  # layer graphs made from a template
        self.per_layer = 0  # layer graphs captured on their own (sharing refused)
        self.reasons: dict[str, int] = {}
        self.pieces: dict[str, "ShareGroup"] = {}  # submodule path -> group, when piecewise
        self.capture_seconds = 0.0  # of the template captures and their diff captures
        self.build_seconds = 0.0  # of the layers' retargeted graphs (instantiate, rewrite)
        self.released = False

    # -- what the engine calls -------------------------------------------------------------

    def pool(self, backend, device: torch.device):
        idx = device.index or 0
        pool = self._pools.get(idx)
        if pool is None or getattr(pool, "retired", False):  # (see _capture.Pool)
            pool = self._pools[idx] = backend.new_pool(device)
        return pool

    def refuse(self, reason: str) -> None:
        self.per_layer += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def make(self, k: int, key, fn, a: tuple, kw: dict, inputs, leaves: list, backend,
             device: torch.device, expected: Any, guard=None, states: Slice | None = None):
        """Layer ``k``'s graph for ``key``: (raw, static outputs, static inputs) or None when
        sharing is refused (the reason is recorded; the caller captures per layer).

        ``guard``: what layer ``k``'s own first call read (module attributes, a
        :class:`~cudagraphify._guards.StateGuard`). Where it read values that differ from what
        the template layer read, the template is not trusted on the strength of the diffed
        pair: layer ``k`` is captured once and diffed against the template itself.

        ``states``: the layer's part of the static states it is passed (a KV cache), rebased
        as its parameters are; whatever the group's runs write in the cache is put back to
        what the real call left there."""
        with self._lock:
            if self.released:
                return None
            for old in [key_ for key_, other in self._templates.items() if other.dead()]:
                # made for a cache that is gone (a new cache per generate()): no call can pass
                # it again; kept while layers' graphs made from it live (see _collect), and no
                # longer counted as one of max_graphs signatures
                self._stale.append(self._templates.pop(old))
            t = self._templates.get(key)
            if t is not None and t.guard is not None and not t.guard.valid():
                # what the template layer read has changed (a config object the layers share):
                # its capture computes with the old values. Its graph stays (layers' graphs made
                # from it read its memory) until release; a new template is captured.
                self._stale.append(self._templates.pop(key))
                t = None
            self._collect()
            # (the template layer's part of the cache and this layer's: the runs below write
            # them, on the CPU a capture's run too; put back after, whatever happens)
            kept = [] if states is None else list(states.tensors) if t is None else \
                [states.every[j] for j in t.positions or ()] + list(states.tensors)
            # (the group's runs are no calls: the module attributes they set are put back, as
            # the engine does after a capture's run; the plain ones of a layer not called yet,
            # which no graph reads, too)
            rec = _watch.Recorder(everything=frozenset(
                id(m) for layer in self.layers for m in layer.modules()))
            with _bytes_kept(kept) as after:
                try:
                    with _watch.recording(rec, ran=False):
                        return self._make(k, key, t, fn, a, kw, inputs, leaves, backend,
                                          device, expected, guard, states, after, rec)
                finally:
                    rec.undo()

    def _make(self, k, key, t, fn, a, kw, inputs, leaves, backend, device, expected, guard,
              states, after, rec):
        if t is None:
            if len(self._templates) >= self.max_templates:
                self.refuse(f"more than max_graphs={self.max_templates} signatures shared")
                return None
            t = self._new_template(k, key, fn, a, kw, inputs, backend, device, guard, states,
                                   rec)
        if t.reason is not None:
            self.refuse(t.reason)
            return None
        try:
            cache = set() if states is None else {p for p, _ in _ranges(states.every)}
            if any(storage_of(x) in cache for x in pytree.tree_leaves(expected)
                   if isinstance(x, torch.Tensor)):
                # (the template's outputs stand for every layer's: one returning a tensor of
                # the cache, its own or another's, gets the graph's copy of what the template
                # layer returned)
                raise Refused("forward returns a tensor of the cache")
            if (states is None) != (t.positions is None):
                raise Refused("the template layer was called without a cache and this layer "
                              "with one, or the other way round")
            differs = _reads_differ(t.reads, _reads_of(self.layers[k], guard))
            if differs is not None:
                if states is None:
                    # a value forward reads that differs may choose between intermediates
                    # that the same kernels made (a mask per layer type): no diff of kernel
                    # arguments tells that apart
                    raise Refused(f"layer {k} read values its template layer did not "
                                  f"({differs}): the template's graph computes with its own")
                # (HF's layer_idx, which picks the layer's part of the cache): proven by
                # captures in one memory state, where such a choice shows
                self._prove_same_memory(t, k, backend, device, differs, states)
            else:
                # a plain attribute of its own (HF's layer_idx) that forward was not seen to
                # read: proven by the layer's own capture, not taken on trust from the recorder
                differs = first_difference(self.layers[t.layer], self.layers[k],
                                           self.ignore_attrs)
                if differs is not None:
                    self._prove(t, k, backend, device,
                                f"has attributes of its own ({differs})", states)
            return self._retarget(t, k, leaves, backend, device, expected, states, after)
        except Refused as e:
            self.refuse(str(e))
            return None
        except CaptureFailed as e:
            self.refuse(f"a capture to prove sharing failed: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - the real call ran: unproven means refused
            self.refuse(f"sharing failed unexpectedly: {type(e).__name__}: {e}")
            return None

    def _relative(self, k: int, sets: list) -> tuple:
        """The sets (``Recorder.sets``) made on layer ``k``'s modules, as (path inside the
        layer, name, value): one per attribute, the value it was set to last, as the run left
        it (keyed by where, not by the value: a constant need not be hashable, a slice before
        Python 3.12)."""
        paths = {id(m): p for p, m in self.layers[k].named_modules()}
        # (constants only: a template whose forward sets an object is refused, see
        # _new_template)
        return tuple({(paths[id(m)], n): (paths[id(m)], n, v) for m, n, v in sets
                      if id(m) in paths and is_constant(v)}.values())

    def layer_sets(self, k: int, key) -> list:
        """What layer ``k``'s graph for ``key`` sets again after a replay: the attributes its
        template layer's capture set to a constant, on layer ``k``'s own modules, as
        (module, name, value)."""
        t = self._templates.get(key)
        out = []
        for path, name, value in t.sets if t is not None else ():
            try:
                out.append((self.layers[k].get_submodule(path), name, value))
            except AttributeError:
                pass
        return out

    def piece_group(self, path: str) -> "ShareGroup":
        """The group of the submodules at ``path`` of every layer (a piecewise plan's piece)."""
        with self._lock:
            group = self.pieces.get(path)
            if group is None:
                subs = [layer.get_submodule(path) for layer in self.layers]
                group = self.pieces[path] = ShareGroup(subs, self.ignore_attrs, self.strict,
                                                       self.max_templates)
            return group

    # -- templates ---------------------------------------------------------------------------

    def _new_template(self, k: int, key, fn, a, kw, inputs, backend, device,
                      guard, states: Slice | None, rec) -> _Template:
        from ._cugraph import DriverError, driver_available, read_graph

        layer = self.layers[k]
        pool = self.pool(backend, device)
        forward_a = self._forward_of(layer)
        # The template is captured from the layer's own forward (not the engine's probed one):
        # a refused template must not count as the engine's capture run.
        raw, out = backend.capture(lambda: forward_a(*a, **kw), device, pool=pool,
                                   keep_graph=True)
        # (what the capture's run set, after the layer's real call: a counter set anew, or a
        # constant set again, which a layer's replay sets too; ``rec``: see ``make``)
        wrote = list(rec.writes)
        sets = self._relative(k, rec.sets)
        self.captures += 1
        self.capture_seconds += raw.capture_seconds
        # (with a cache, not the call: it would keep the cache alive; see _call)
        t = _Template(raw, k, [], None, _storages(layer, states), _layout(layer), inputs, out,
                      reads=_reads_of(layer, guard), call=(a, kw) if states is None else None,
                      guard=guard, positions=None if states is None else states.positions,
                      cache=_weak(states.objects[0]) if states is not None else None,
                      sets=sets)
        try:
            if wrote:
                # (each layer's replay would leave it as it is; the engine refuses the layer's
                # own graph for it too, see _first_call.verify)
                module, name, _, _ = wrote[0]
                raise Refused(f"forward sets {type(module).__name__}.{name} on every call (a "
                              "Python side effect a replay cannot repeat)")
            own = frozenset(id(m) for m in layer.modules())
            objects = [(m, n) for m, n, v in rec.sets if id(m) in own and not is_constant(v)
                       and _watch.From.find(v, rec.reads, own) is not None]
            if objects:
                # (an object the layer read from an attribute of its own, ``self.keep =
                # self.value``: a layer's own graph sets it again, see _first_call._sets; the
                # template's replay could not set another layer's)
                module, name = objects[0]
                raise Refused(f"forward sets {type(module).__name__}.{name} to an object of "
                              "its own on every call (each layer's graph sets its own)")
            if len(self.layers) < 2:
                raise Refused("one layer: nothing to share")
            if not driver_available():
                raise Refused("the CUDA driver cannot report kernel argument sizes "
                              "(CUDA 12.4 or later is needed)")
            self._check_outputs(out, inputs, t.storages)
            self._check_no_rng(raw, device)
            other = self._partner(k)
            forward_b = self._forward_of(self.layers[other])
            # Layer b may not have run yet: its first run (lazy state, autotuning) happens
            # eagerly, as its own first call would, not inside the capture. The forward writes
            # no tensor state but the cache's (the engine refuses sharing otherwise); layer b
            # runs and is captured on a copy of the cache, whose part it used is its own.
            a_b, kw_b, b_part = a, kw, None
            if states is not None:
                a_b, kw_b, b_part = self._partner_on_copy(t, forward_b, other, states, backend,
                                                          device)
            else:
                with torch.no_grad():
                    backend.warmup(lambda: forward_b(*a, **kw), device)
            extra = []

            def capture(f, a=a, kw=kw):
                r, _ = backend.capture(lambda: f(*a, **kw), device, pool=pool, keep_graph=True)
                extra.append(r)
                self.captures += 1
                self.capture_seconds += r.capture_seconds
                return read_graph(r.cuda_graph())

            try:
                nodes0, edges0 = read_graph(raw.cuda_graph())
                nodes1, edges1 = capture(forward_b, a_b, kw_b)
                del a_b, kw_b
                t.nodes = nodes0
                pool_mem, _ = memory_ranges(pool)
                b_storages = _storages(self.layers[other], b_part)
                readable = None if self.strict else self._readable(t, pool_mem, b_storages)

                host = functools.cache(host_ranges)

                def plan(again):
                    return plan_rebase(nodes0, nodes1, edges0, edges1, t.storages, b_storages,
                                       pool_mem, again, readable, host)

                t.edges = edges0
                try:
                    t.plan = plan(None)
                except Refused:
                    # Some difference is not a rebased address nor two intermediates: capture
                    # layer a once more to tell capture-dependent bytes (padding) from the rest.
                    t.again, _ = capture(forward_a)
                    t.plan = plan(t.again)
            finally:
                for r in extra:
                    r.release()
        except Refused as e:
            t.reason = str(e)
        except DriverError as e:
            t.reason = f"reading the captured graph failed: {e}"
        except Exception as e:  # noqa: BLE001 - unproven means refused, with the reason
            t.reason = f"sharing failed unexpectedly: {type(e).__name__}: {e}"
        # A refused template is kept all the same: the group's pool must keep one live graph for
        # the per-layer captures that follow (a pool whose graphs are all gone is unusable).
        self._templates[key] = t
        return t

    def _partner_on_copy(self, t: _Template, forward_b, b: int, states: Slice, backend,
                         device) -> tuple:
        """Layer ``b``'s first run, on a copy of the cache (the real one holds what the real
        call left): its (args, kwargs) on the template's static inputs and the copy, and its
        part of the copy (what it read or wrote, found by a probe). Refused where that part
        is not laid out as the template layer's."""
        from ._piecewise import probed

        try:
            with torch.no_grad():
                copies = copy.deepcopy(list(states.objects))
        except torch.OutOfMemoryError:
            raise Refused("out of memory copying the cache for the layer to diff with") \
                from None
        except Exception as e:  # noqa: BLE001 - an object deepcopy cannot copy
            raise Refused(f"the cache cannot be copied ({type(e).__name__}: {e})") from None
        a_b, kw_b = states.call_on(t.inputs.leaves, copies)
        probe = states.new_probe()
        with torch.no_grad():
            backend.warmup(probed(probe, lambda: forward_b(*a_b, **kw_b)), device)
        every = [x for obj in copies for x in _tensors_in(obj)]
        if len(every) != len(states.every):
            raise Refused(f"layer {b}'s run set the copy of the cache up differently")
        touched = set(probe.outside) | probe.written
        part = [x for x in every if storage_of(x) in touched]
        if _part_layout(part) != _part_layout(states.tensors):
            raise Refused(f"layer {b} uses another part of the cache than layer {t.layer} "
                          f"({len(part)} vs {len(states.tensors)} tensors, or laid out "
                          "differently)")
        return a_b, kw_b, part

    @staticmethod
    def _call(t: _Template, states: Slice | None) -> tuple:
        """The template's call (args, kwargs), on its static inputs: with a cache, the one
        this call is passed (the template keeps none: it would keep a cache alive)."""
        if states is None:
            return t.call
        return states.call_on(t.inputs.leaves, states.objects)

    @staticmethod
    def _readable(t: _Template, pool_mem, other: Storages) -> list[tuple[int, int]]:
        """What the layers' forward may read (strict=False's ``device`` ranges): the pool, the
        two layers' storages, the static inputs, tensors the template's forward read as module
        attributes. A differing value in none of it is a stale struct byte (unproven)."""
        tensors = [x for x in t.inputs.leaves if isinstance(x, torch.Tensor)]
        if t.guard is not None:
            tensors += list(t.guard.tensors)
        return readable_ranges(pool_mem, [t.storages, other], tensors)

    def _partner(self, k: int) -> int:
        for j in list(range(k + 1, len(self.layers))) + list(range(k)):
            layer = self.layers[j]
            if Storages.of(layer).ranges != Storages.of(self.layers[k]).ranges \
                    and _layout(layer) == _layout(self.layers[k]):
                return j
        raise Refused("no second layer with its own storages and the same layout to diff with")

    @staticmethod
    def _forward_of(layer: torch.nn.Module):
        fwd = layer.__dict__.get("forward")
        return getattr(fwd, "__wrapped__", None) or type(layer).forward.__get__(layer)

    @staticmethod
    def _check_outputs(out, inputs, storages: Storages) -> None:
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and storages.find(t.untyped_storage().data_ptr()):
                raise Refused("forward returns a parameter or buffer (or a view of one)")

    @staticmethod
    def _check_no_rng(raw, device) -> None:
        if device.type != "cuda":
            return
        gen = torch.cuda.default_generators[device.index or 0]
        before = gen.get_offset()
        with _writes.rng_kept(device):  # (the user's random stream stays as eager's)
            raw.replay()  # a replay advances the generator by what the graph draws
            drew = gen.get_offset() != before
        if drew:
            raise Refused("random ops (dropout in train mode): one shared graph cannot draw "
                          "fresh numbers per layer")

    def _prove(self, t: _Template, k: int, backend, device, differs: str,
               states: Slice | None = None) -> None:
        """Capture layer ``k`` and diff it against the template: it may use the template only
        when every difference is a rebased address of its own storages or capture-dependent
        (the values its forward read that differ changed no kernel argument). Raises
        :class:`Refused` otherwise."""
        from ._cugraph import DriverError, read_graph

        layer = self.layers[k]
        forward = self._forward_of(layer)
        pool = self.pool(backend, device)
        a, kw = self._call(t, states)  # on the template's inputs: its graph reads them, as
        # layer k's will
        raw, _ = backend.capture(lambda: forward(*a, **kw), device, pool=pool, keep_graph=True)
        self.captures += 1
        self.capture_seconds += raw.capture_seconds
        try:
            nodes, edges = read_graph(raw.cuda_graph())
            pool_mem, _ = memory_ranges(pool)
            # (a one-byte argument that differs is kept and counted, as in the template's own
            # diff: empty functors hold host-stack bytes that differ between layers, seen on
            # GPT-2's layers on the H200, and refusing them refused 5 of its 12 layer graphs. A
            # one-byte flag of the layer's own that forward is seen to read refuses above.)
            mine = _storages(layer, states)
            proof = plan_rebase(t.nodes, nodes, t.edges, edges, t.storages, mine, pool_mem,
                                t.again,
                                None if self.strict else self._readable(t, pool_mem, mine),
                                functools.cache(host_ranges))
            if t.plan is not None:
                t.plan.unproven += proof.unproven
        except Refused as e:
            raise Refused(f"layer {k} {differs} and its own capture differs from the "
                          f"template's: {e}") from None
        except DriverError as e:
            raise Refused(f"reading layer {k}'s capture failed: {e}") from None
        finally:
            raw.release()

    def _prove_same_memory(self, t: _Template, k: int, backend, device, differs: str,
                           states: Slice) -> None:
        """Layer ``k`` read values its template layer did not (HF's ``layer_idx``, which picks
        its part of the cache): it may use the template only when its capture is the template
        layer's but for its own storages' addresses, with the same intermediates. Two captures
        of the template layer, then one of layer ``k``, are made from one memory state (each
        released before the next), so that the same work lays its intermediates out alike: an
        address in the pool that differs (a value that chose another intermediate) refuses, as
        does any other byte that differs unless it is a rebased address of the layer's own
        storages, differs between the template layer's two captures too (host leftovers) or
        is one the kernel never reads. Raises :class:`Refused` otherwise."""
        from ._cugraph import DriverError, read_graph

        why = f"layer {k} read values its template layer did not ({differs})"
        a, kw = self._call(t, states)
        pool = self.pool(backend, device)

        def once(layer):
            forward = self._forward_of(layer)
            raw, out = backend.capture(lambda: forward(*a, **kw), device, pool=pool,
                                       keep_graph=True)
            del out  # (its memory back in the pool before the next capture)
            self.captures += 1
            self.capture_seconds += raw.capture_seconds
            try:
                return read_graph(raw.cuda_graph())
            finally:
                raw.release()

        try:
            again, _ = once(self.layers[t.layer])
            nodes0, edges0 = once(self.layers[t.layer])
            nodes1, edges1 = once(self.layers[k])
            pool_mem, _ = memory_ranges(pool)
            _same_memory(nodes0, again, pool_mem)
            mine = _storages(self.layers[k], states)
            proof = plan_rebase(nodes0, nodes1, edges0, edges1, t.storages, mine, [], again,
                                None, None)
        except Refused as e:
            raise Refused(f"{why} and its capture differs from the template layer's in one "
                          f"memory state: {e}") from None
        except DriverError as e:
            raise Refused(f"reading layer {k}'s capture failed: {e}") from None
        if proof.unproven:
            raise Refused(f"{why} and {proof.unproven} argument(s) of its capture differ from "
                          "the template layer's that are not proven unread")
        if _slots(proof) != _slots(t.plan):
            raise Refused(f"{why} and its capture rebases other arguments than the "
                          "template's plan")

    # -- layers' graphs ----------------------------------------------------------------------

    def _retarget(self, t: _Template, k: int, leaves: list, backend, device, expected,
                  states: Slice | None = None, after: dict | None = None):
        from ._cugraph import DriverError, RetargetedExec

        layer = self.layers[k]
        if _layout(layer) != t.layout:
            raise Refused(f"layer {k}'s parameters no longer match the template layer's")
        mine = _storages(layer, states)
        t.plan.check(t.storages, mine, k, 256 if device.type == "cuda" else 1)
        t0 = time.perf_counter()
        chunks = {i: n.chunks for i, n in enumerate(t.nodes)}
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                exe = RetargetedExec(t.raw.cuda_graph(), t.plan.patches(chunks, mine),
                                     device.index or 0, t.nodes)
        except DriverError as e:
            raise Refused(f"rewriting the graph failed: {e}") from e
        raw = RetargetedRaw(exe, lambda: backend.stream_token(device), time.perf_counter() - t0,
                         t.raw.pool, recycle=functools.partial(self._done, t))
        t.users += 1
        # Every layer's graph is checked once against its eager output of this call.
        for i, buf in t.inputs.copy:
            buf.copy_(leaves[i])
        parts, want = [], []
        if states is not None:
            # and, with a cache, against what the call did to it: its part back as the call
            # found it, the replay must leave it as the call did, and the template layer's
            # part as it is (``after``: both as the call left them; put back by ``make``)
            theirs = [states.every[j] for j in t.positions]
            if _ranges(theirs) != t.storages.ranges[len(t.storages.ranges) - len(theirs):]:
                raw.release()
                raise Refused("the template layer's part of the cache has moved")
            parts = list(states.tensors) + [x for x in theirs
                                            if all(x is not y for y in states.tensors)]
            want = [after[id(x)] for x in parts]
            with torch.no_grad():
                for x, b in zip(states.tensors, states.before):
                    x.copy_(b)
        try:
            raw.replay()
        except DriverError as e:
            raw.release()
            raise Refused(f"launching the rewritten graph failed: {e}") from e
        got = [x for x in pytree.tree_leaves(t.out) if isinstance(x, torch.Tensor)] + parts
        want = [x for x in pytree.tree_leaves(expected) if isinstance(x, torch.Tensor)] + want
        # Bitwise: the graph runs the kernels eager ran, so any difference (a per-layer value
        # the template baked in, however small) refuses.
        if len(got) != len(want) or not all(
                g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)
                for g, w in zip(got, want)):
            raw.release()
            raise Refused(f"layer {k}'s retargeted graph does not equal its eager output "
                          "bitwise" + (" (or does not leave the cache as eager did)"
                                       if states is not None else ""))
        self.retargets += 1
        self.build_seconds += raw.capture_seconds
        return raw, t.out, t.inputs

    # -- reporting and release ---------------------------------------------------------------

    def stats(self) -> Stats:
        """The group's counters (see :class:`~cudagraphify.Stats`): its own captures and
        sharing decisions, and its layers' calls summed."""
        with self._lock:
            return self._stats()

    def _stats(self) -> Stats:
        calls = sum((state.stats() for state in map(state_of_module, self.layers)
                     if state is not None), Stats())
        plans = {str(k): t.plan for k, t in self._templates.items() if t.plan is not None}
        return dataclasses.replace(
            calls, captures=self.captures, retargets=self.retargets,
            capture_seconds=self.capture_seconds, layers=len(self.layers),
            per_layer=self.per_layer, reasons=dict(self.reasons),
            rebased_slots={k: plan.count for k, plan in plans.items()},
            unproven_slots={k: plan.unproven for k, plan in plans.items() if plan.unproven},
            template_pool_bytes=sum(t.raw.pool_bytes for t in (*self._templates.values(),
                                                               *self._stale)),
            build_seconds=self.build_seconds,
            pieces={path: g.stats() for path, g in self.pieces.items()})

    def _done(self, t: _Template, exe) -> None:
        """A layer's graph made from ``t`` is released (its ``RetargetedRaw``)."""
        exe.destroy()
        with self._lock:
            t.users -= 1
            self._collect()

    def _collect(self) -> None:
        """Release the replaced templates (their cache gone, or what they read changed) that
        no layer's graph reads any more; while a current template keeps the pool alive (a
        pool whose graphs are all gone is unusable, see ``_new_template``)."""
        if not self._templates:
            return
        for t in [t for t in self._stale if t.users <= 0]:
            self._stale.remove(t)
            t.raw.release()

    def release(self) -> None:
        """Release every layer's graphs and the templates (the layers stay graphified)."""
        with self._lock:
            for layer in self.layers:
                state = state_of_module(layer)
                if state is not None:
                    state.release()
            for t in [*self._templates.values(), *self._stale]:
                t.raw.release()
            self._templates.clear()
            self._stale.clear()
            self._pools.clear()  # their keeper graphs go, and the pools' memory with them
            for group in self.pieces.values():
                group.release()

    def unshare(self) -> None:
        """Release everything and restore the layers' own forwards."""
        self.release()
        self.released = True
        for layer in self.layers:
            if share_of(layer) is not None:
                uninstall_instance(layer)


def _storages(layer: torch.nn.Module, part) -> Storages:
    """A layer's storages: its parameters and buffers, then its part of the cache (a
    :class:`Slice` or a list of tensors), in order."""
    own = Storages.of(layer)
    if part is None:
        return own
    return Storages(own.ranges + _ranges(part.tensors if isinstance(part, Slice) else part))


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


def _slots(plan: RebasePlan | None) -> set:
    """The argument slots a plan rebases, with where to: {(node, argument, byte, storage,
    offset)}."""
    if plan is None:
        return set()
    return {(i, c, *slot) for i, chunks in plan.slots.items() for c, slots in chunks.items()
            for slot in slots}


def _same_memory(nodes0: list, nodes1: list, pool: list[tuple[int, int]]) -> None:
    """Refuse two captures of one layer made from one memory state whose arguments hold
    addresses in the pool that differ: the allocator laid the same work out otherwise, so
    addresses cannot tell intermediates apart."""
    def in_pool(v):
        return any(start <= v < start + n for start, n in pool)

    for i, (n0, n1) in enumerate(zip(nodes0, nodes1)):
        for x, y in zip(n0.chunks, n1.chunks):
            for pos in range(0, len(x) - 7, 8):
                v0 = int.from_bytes(x[pos:pos + 8], "little")
                v1 = int.from_bytes(y[pos:pos + 8], "little")
                if v0 != v1 and in_pool(v0) and in_pool(v1):
                    raise Refused(f"node {i} ({n0.name}): two captures of the template layer "
                                  "in one memory state placed an intermediate differently")


def _reads_of(layer: torch.nn.Module, guard) -> dict:
    """What a layer's forward read (a StateGuard's reads), by module path inside the layer."""
    if guard is None:
        return {}
    paths = {id(m): p for p, m in layer.named_modules()}
    return {(paths.get(id(m), f"<outside {id(m)}>"), name): value
            for m, name, value in guard.reads}


def _reads_differ(template: dict, mine: dict) -> str | None:
    """The first value a layer read that differs from what the template layer read, in words
    (objects compared by identity, as a graph's guard does), or None."""
    from ._watch import same, short

    for key in template.keys() | mine.keys():
        a, b = template.get(key, _ABSENT), mine.get(key, _ABSENT)
        if not same(a, b):
            path, name = key
            return f"{path + '.' if path else ''}{name}: {short(a)} vs {short(b)}"
    return None


_ABSENT = object()


def _layout(layer: torch.nn.Module) -> list:
    return [(n, _describe(t)) for n, t in
            list(layer.named_parameters()) + list(layer.named_buffers())]


def check_layers(layers: Any, ignore_attrs: tuple[str, ...]) -> list[torch.nn.Module]:
    """The layers as a list, after checking they are modules with identical structure."""
    if isinstance(layers, torch.nn.Module) and not isinstance(
            layers, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise CudagraphifyUsageError("share_graph takes an nn.ModuleList or a sequence of "
                                     f"modules, not one {type(layers).__name__}")
    try:
        layers = list(layers)
    except TypeError:
        raise CudagraphifyUsageError("share_graph takes an nn.ModuleList or a sequence of "
                                     f"modules, not {type(layers).__name__}") from None
    if not layers:
        raise CudagraphifyUsageError("share_graph needs at least one layer")
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise CudagraphifyUsageError(f"share_graph: item {i} is a {type(layer).__name__}, "
                                         "not an nn.Module")
        if any(layer is other for other in layers[:i]):
            raise CudagraphifyUsageError(f"share_graph: item {i} is the same module as an "
                                         "earlier one")
        if share_of(layer) is not None:
            raise CudagraphifyUsageError(f"share_graph: layer {i} already shares a graph")
    for i, layer in enumerate(layers[1:], 1):
        # (plain attributes that differ, as HF's layer_idx, are proven per layer when its
        # graph is made: ShareGroup.make)
        diff = first_difference(layers[0], layer, ignore_attrs, attrs=False)
        if diff is not None:
            raise CudagraphifyError(f"share_graph: layer {i} differs from layer 0: {diff}")
    return layers
