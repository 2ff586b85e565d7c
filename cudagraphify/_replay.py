"""How a captured graph runs: static input buffers, copy-in, replay, copy-back, outputs.

Everything that can be decided at capture time is decided there (which leaves are copied, which
are read in place, what each output leaf becomes); :meth:`CapturedGraph.run` only executes that
plan. Outputs that live in the graph's pool are cloned by default, so a later replay never
overwrites a tensor the caller holds; ``copy_outputs=False`` returns the static tensors'
memory (zero copy, overwritten by the next call), as a new tensor object each call.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ._cache import Owned
from ._copies import clone_keeps, copyable, overlaps, rebuild, recipes, span_of, span_view
from ._errors import CudagraphifyError
from ._signature import is_constant

__all__ = ["StaticInputs", "CapturedGraph", "plan_outputs", "output_leaves", "OutputPlanError",
           "OpaqueOutput", "opaque_output",
           "clone_output", "static_output"]

_data = torch.Tensor.data.__get__  # ``t.data`` as a function of ``t``
_Parameter = torch.nn.Parameter


class OutputPlanError(CudagraphifyError):
    """An output cannot be returned safely from a graph (the signature then runs eagerly)."""


class OpaqueOutput(OutputPlanError):
    """An output object a graph cannot tell the contents of (``kind``: its type)."""

    def __init__(self, message: str, kind: type):
        super().__init__(message)
        self.kind = kind


class StaticInputs:
    """Static buffers for the copied tensor leaves of one signature.

    Marked-static leaves and non-tensor leaves are used as they are. A copied leaf gets a buffer
    with its exact strides when its memory does not overlap itself; an overlapping view (from
    ``expand``) gets a contiguous buffer, since a copy cannot write into overlapping memory.
    """

    def __init__(self, leaves: list, static_flags: list[bool],
                 borrow: dict[int, torch.Tensor] | None = None):
        # (under no_grad a copy of an argument that requires grad requires grad too: a forward
        # may read it, ``x.requires_grad``, and the key tells the two apart)
        marked = not torch.is_grad_enabled()
        with torch.no_grad():
            self._build(leaves, static_flags, borrow or {}, marked)

    def _build(self, leaves: list, static_flags: list[bool],
               borrow: dict[int, torch.Tensor], marked: bool) -> None:
        self.leaves: list = []
        self.copy: list[tuple[int, torch.Tensor]] = []
        self.same_layout: dict[int, bool] = {}
        # a tensor passed twice (``f(x, x)``, a key of its own: _signature.repeated) gets one
        # buffer, so that the run on the copies sees what the call saw (``x is y``), unless it
        # requires grad under grad mode (a graph gives each input its own gradient: such a
        # call is not captured, see _first_call)
        first: dict[int, int] = {}
        # (one read in place is read in place wherever it is passed: ``f(x, kv=x)`` with ``kv``
        # named static)
        in_place = {id(leaf) for leaf, static in zip(leaves, static_flags)
                    if static and isinstance(leaf, torch.Tensor)}
        for i, (leaf, static) in enumerate(zip(leaves, static_flags)):
            j = first.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if i in borrow:  # another graph's static output, with this leaf's layout: no buffer
                self.copy.append((i, borrow[i]))
                self.leaves.append(borrow[i])
                self.same_layout[i] = True
                first.setdefault(id(leaf), i)  # (passed twice: the slot for both)
            elif isinstance(leaf, torch.Tensor) and not static and id(leaf) in in_place \
                    and (marked or not leaf.requires_grad):
                self.leaves.append(leaf)
            elif j is not None and not static and (marked or not leaf.requires_grad):
                buf = self.leaves[j]
                self.copy.append((i, buf))
                self.leaves.append(buf)
                self.same_layout[i] = self.same_layout[j]
            elif isinstance(leaf, torch.Tensor) and not static:
                first.setdefault(id(leaf), i)
                if not overlaps(leaf):
                    buf = torch.empty_strided(leaf.size(), leaf.stride(), dtype=leaf.dtype,
                                              device=leaf.device)
                    self.same_layout[i] = True
                else:
                    buf = torch.empty(leaf.size(), dtype=leaf.dtype, device=leaf.device)
                    self.same_layout[i] = False
                # (a conj or neg view, as the argument is: an op that reads the bit,
                # ``resolve_conj`` returning its input unless it is set, does on the copy what
                # it does on the argument; ``copy_`` writes the values the view shows)
                if leaf.is_conj():
                    buf = buf.conj()
                if leaf.is_neg():
                    buf = buf._neg_view()
                buf.copy_(leaf)
                if marked and leaf.requires_grad and (buf.is_floating_point() or buf.is_complex()):
                    buf.requires_grad_(True)
                if type(leaf) is _Parameter:
                    # (a Parameter the module does not own, copied: the copy is one too, on the
                    # same memory, so the capture sees the class the call does; the class is in
                    # the key, see _signature.leaf_kind)
                    buf = _Parameter(buf, requires_grad=buf.requires_grad)
                self.copy.append((i, buf))
                self.leaves.append(buf)
            else:
                self.leaves.append(leaf)

    def storage_index(self) -> dict[int, int]:
        """Map storage address → leaf index, for every non-empty tensor leaf (copied or read
        in place)."""
        out = {}
        for i, leaf in enumerate(self.leaves):
            if isinstance(leaf, torch.Tensor):
                ptr = leaf.untyped_storage().data_ptr()
                if ptr:
                    out.setdefault(ptr, i)
        return out


def _once(copy: list) -> list:
    """``StaticInputs.copy`` with one entry per buffer (the first leaf that has it)."""
    seen: set[int] = set()
    out = []
    for i, buf in copy:
        if id(buf) not in seen:
            seen.add(id(buf))
            out.append((i, buf))
    return out


def _view_of_input(i: int, out: torch.Tensor, static: torch.Tensor) -> Callable[[list], Any]:
    """How a replay returns ``out``, the graph's input ``i`` (``static``) or a view of it, on
    the caller's tensor: the caller's object where forward returned its argument itself (as
    eager does), else a new view of it with ``out``'s dtype, layout and conj/neg bits (a new
    object: what the caller does to it must not reach their argument's metadata)."""
    if out is static:
        return lambda leaves: leaves[i]
    if type(out) is not torch.Tensor and type(out) is not torch.nn.Parameter:
        raise OutputPlanError(
            f"forward returns argument {i} as a {type(out).__name__}: a replay's view of the "
            "argument you pass would be a plain tensor")
    if out.element_size() != static.element_size():
        raise OutputPlanError(
            f"forward returns a view of argument {i} as {out.dtype} (its elements "
            f"{out.element_size()} bytes, the argument's {static.element_size()}): a replay "
            "cannot rebuild it on the argument you pass")
    size, stride = out.size(), out.stride()
    delta = out.storage_offset() - static.storage_offset()
    dtype = out.dtype if out.dtype != static.dtype else None
    conj, neg = out.is_conj() != static.is_conj(), out.is_neg() != static.is_neg()
    if not out._is_view() and not out.is_inference():
        # an alias autograd does not see as a view (``x.detach()``, ``x.view(torch.int32)``):
        # one of the caller's tensor, of its own too (an inference tensor's views are not
        # tracked either: they take the path below)
        if conj or neg or size != static.size() or stride != static.stride() or delta:
            raise OutputPlanError(
                f"forward returns an alias of argument {i} that is no view of it, with "
                "another layout: a replay cannot make one of the tensor you pass")
        if dtype is None:
            return lambda leaves: leaves[i].detach()
        return lambda leaves: leaves[i].detach().view(dtype)
    # a view (for autograd) of the argument, or of an alias of it (``x.detach()[1:]``,
    # ``x.view(torch.int32)[1:]``: a view of its detached alias)
    root = static._base if static._base is not None else static
    detached = out._base is not root

    def view(leaves: list) -> torch.Tensor:
        x = leaves[i].detach() if detached else leaves[i]
        v = (x if dtype is None else x.view(dtype)).as_strided(size, stride,
                                                               x.storage_offset() + delta)
        if conj:  # (each flips its bit: a view, as eager's)
            v = v.conj()
        if neg:
            v = torch._neg_view(v)
        return v
    return view


def clone_output(t: torch.Tensor, lone: bool = True) -> Callable:
    f = lambda leaves, outs: t.clone()  # noqa: E731
    f.fresh = t.clone  # a graph with this one output calls it itself (one frame less)
    return f


def static_output(t: torch.Tensor, lone: bool = True) -> Callable:
    # (a new tensor object on the graph's memory each call, as eager returns a new tensor: what
    # the caller does to the one it got, ``t_()``, ``requires_grad_()``, an attribute, must not
    # reach the next call's output)
    # ``lone`` (no other output on its memory): ``.data``, an alias with a version counter of
    # its own, as eager's new tensor has (cheaper to make than ``detach()``); else one that
    # shares the counter of this call's first output on that memory, as eager's views of one
    # another share theirs (``of_this_call``)
    if lone:
        f = lambda leaves, outs: t.data  # noqa: E731
        f.fresh = functools.partial(_data, t)  # (as ``clone_output``'s)
    else:
        f = lambda leaves, outs: of_this_call(t, outs)  # noqa: E731
        f.fresh = t.detach
    f.static = t  # (its memory is the caller's too: see ``CapturedGraph.handed``)
    return f


def of_this_call(t: torch.Tensor, outs: list | None) -> torch.Tensor:
    """A static output ``t`` that shares its memory with another output of its graph, handed
    out with the version counter of this call's output already made on that memory (``outs``,
    the call's outputs so far), as eager's outputs on one memory share theirs, and with no
    other call's: a ``detach()`` of that output with ``t``'s layout, a tensor of its own
    (autograd sees no view: no base that keeps the other alive, see ``_region.Slot.move``;
    more permissive than eager's view, never less); in another dtype or with a conj/neg bit,
    a view of such a ``detach()`` (detached again where eager's is no view). The first on that
    memory: ``.data``, a counter of its own. Where neither can be made: ``detach()`` of ``t``, the static's counter, which every
    call's share (an in-place write to a later call's output moves an earlier one's version:
    a false alarm of autograd's at worst, never a write it misses)."""
    if not outs:
        return t.data
    ptr = t.untyped_storage().data_ptr()
    o = next((o for o in outs if type(o) is torch.Tensor
              and o.untyped_storage().data_ptr() == ptr), None)
    if o is None:
        return t.data
    if o.layout is not torch.strided or t.layout is not torch.strided:
        return t.detach()
    d = o.detach()  # (its counter; an inference tensor has none)
    if d.dtype == t.dtype and not (d.is_conj() or d.is_neg() or t.is_conj() or t.is_neg()):
        if d.size() != t.size() or d.stride() != t.stride() \
                or d.storage_offset() != t.storage_offset():
            with contextlib.nullcontext() if d.is_inference() else _same_version(d):
                d.set_(d.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        return d
    try:
        if d.is_conj():  # (the memory's own values, then t's bits)
            d = d.conj()
        if d.is_neg():
            d = torch._neg_view(d)
        v = view_on(d, t.dtype, t.size(), t.stride(), t.storage_offset(), t.is_conj(),
                    t.is_neg())
    except RuntimeError:  # (another element size, the last dimension strided)
        return t.detach()
    # (no view where eager's is none, ``view_as_real(y).detach()``: its counter all the same)
    return v if t._is_view() else v.detach()


def view_on(base: torch.Tensor, dtype: torch.dtype, size, stride, offset: int, conj: bool,
            neg: bool) -> torch.Tensor:
    """A view of ``base``'s memory (``base`` without conj/neg bits) as ``dtype``, with that
    layout (``offset`` in elements of ``dtype``) and those bits; RuntimeError where no view
    can be (another element size, ``base``'s last dimension strided)."""
    v = (base if base.dtype == dtype else base.view(dtype)).as_strided(size, stride, offset)
    if conj:
        v = v.conj()
    if neg:
        v = torch._neg_view(v)
    return v


_same_version = torch.autograd._unsafe_preserve_version_counter


def _handed_static(action) -> torch.Tensor | None:
    """The static output an output action hands out without a copy, if it does: a
    ``static_output``'s tensor, or a region slot's (its bound ``hand_out``)."""
    t = getattr(action, "static", None)
    if t is None:
        t = getattr(getattr(action, "__self__", None), "static", None)
    return t


def refuse_lost_kind(t: torch.Tensor) -> None:
    """Raise :class:`OutputPlanError` for an output a replay cannot hand out as eager does when
    it makes it anew by an op: an ``nn.Parameter`` (its ops make plain tensors; another
    subclass's keep their class) or one that carries Python attributes (no op keeps them)."""
    if isinstance(t, _Parameter) or t.__dict__:
        raise OutputPlanError(
            f"forward returns a {type(t).__name__}"
            f"{' that carries Python attributes' if t.__dict__ else ''}: a replay would hand "
            "out a plain tensor, without its class or attributes")


def _is_size(x: Any) -> bool:
    return type(x) is torch.Size


def output_leaves(out: Any, call_leaves: list) -> tuple[list[tuple[str, Any]], Any]:
    """Each flat output leaf of a capture as ``("tensor", t)``, ``("arg", leaf index)`` (a
    non-tensor argument object returned as it is) or ``("const", value)``; and the spec.

    The one rule for what a graph may return (inference and training plans build on it):
    anything else raises :class:`OutputPlanError`."""
    _attributes_kept(out)
    # (a torch.Size whole, a constant: pytree would rebuild it as a plain tuple)
    flat, spec = pytree.tree_flatten(out, is_leaf=_is_size)
    by_id = {id(leaf): i for i, leaf in enumerate(call_leaves) if not isinstance(leaf, torch.Tensor)}
    kinds: list[tuple[str, Any]] = []
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            try:
                leaf.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError, TypeError) as e:
                raise OutputPlanError(
                    f"forward returns a {type(leaf).__name__} with no storage of its own (a "
                    f"wrapper tensor subclass, a jagged nested tensor): a graph cannot hand "
                    f"out its memory ({type(e).__name__}: {str(e)[:80]})") from None
            kinds.append(("tensor", leaf))
        elif id(leaf) in by_id:
            kinds.append(("arg", by_id[id(leaf)]))
        elif is_constant(leaf):
            kinds.append(("const", leaf))
        else:
            raise OpaqueOutput(
                f"forward returns an object of type {type(leaf).__name__} that is not a tensor, "
                "an immutable value or an argument; a graph cannot tell what it holds (register "
                "its type with torch.utils._pytree to make it transparent)", type(leaf))
    return kinds, spec


def _attributes_kept(out: Any) -> None:
    """Raise :class:`OutputPlanError` where a dict-like output (an HF ``ModelOutput``) carries
    an attribute that is none of its items (``out.extra = t`` in forward): pytree rebuilds it
    from its items, so a replay's would lack it. (A ``ModelOutput``'s fields left None are
    attributes, not items: the rebuilt one has them too.)"""
    for x in containers_of(out):
        if isinstance(x, dict) and type(x) not in (dict, collections.OrderedDict):
            d = getattr(x, "__dict__", None)
            extra = [k for k, v in d.items() if v is not None and not (k in x and x[k] is v)] \
                if type(d) is dict else []
            if extra:
                raise OutputPlanError(
                    f"forward returns a {type(x).__name__} carrying the attribute "
                    f"{extra[0]!r}, which is none of its items: a graph rebuilds it from its "
                    "items, so a replay's would lack it (make it a field, or return it apart)")


def containers_of(out: Any) -> list:
    """The containers of ``out``'s tree (its pytree nodes; a ``torch.Size`` is a leaf). (Each
    node's children taken by its own flatten: no closure or cycle keeps a leaf referenced
    after this returns, see _outobjects.)"""
    found, todo = [], [out]
    while todo:
        x = todo.pop()
        if _is_size(x) or pytree._is_leaf(x):
            continue
        found.append(x)
        todo.extend(pytree.SUPPORTED_NODES[pytree._get_node_type(x)].flatten_fn(x)[0])
    return found


def opaque_output(out: Any, call_leaves: list) -> str | None:
    """Why ``out`` holds an HF cache object no replay can make (an ``EncoderDecoderCache``: see
    _outobjects for those it can), else None. Such a module runs eagerly with its submodules
    graphed as pieces (see ``FirstCall._screen``), as before ``torch.tensor([])`` was found
    safe (its attentions were unsafe then). An object of another kind keeps its module wholly
    eager (its capture's output plan refuses it): a tensor returned both in the output and
    inside such an object would come back as two (review 163, finding 1: the copy of a
    piecewise root's outputs sees only the tensors pytree flattens). (What else a graph cannot
    return is found when its capture plans the outputs.)"""
    try:
        output_leaves(out, call_leaves)
    except OpaqueOutput as e:
        return str(e) if e.kind.__module__ == "transformers.cache_utils" else None
    except OutputPlanError:
        return None
    return None


def plan_outputs(
    out: Any,
    inputs: StaticInputs,
    call_leaves: list,
    persistent_storages: set[int],
    pool_output: Callable[[torch.Tensor], Callable],
    persistent_ids: set[int] = frozenset(),
) -> tuple[list[Callable[[list], Any]], Any]:
    """Decide, once, how each output leaf of the capture is produced on replay.

    - an empty tensor: a fresh empty tensor (every empty tensor has address 0: it must never
      be mistaken for an input or another output);
    - a tensor aliasing an input: the same view of the caller's input;
    - a tensor in memory the caller owns (a parameter, a buffer, a tensor kept as a module
      attribute): returned as is (``persistent_ids``: those tensors' ids), or as a fresh view
      where it is a view of one, never a graph slot;
    - another tensor (in the graph's pool): ``pool_output(t, lone)`` says (a clone, the static
      tensor itself, or a region's protected alias; ``lone``: no other output on its memory);
    - an immutable value: returned as is; an argument object: the caller's object.
    """
    kinds, spec = output_leaves(out, call_leaves)
    by_storage = inputs.storage_index()
    actions = _Actions()
    seen: dict[int, int] = {}
    pool: dict[int, list[int]] = {}  # storage address -> the pool leaves on it, in order
    for k, (kind, leaf) in enumerate(kinds):
        if kind == "tensor":
            if id(leaf) in seen:  # the same tensor twice: one copy, returned twice
                actions.append(("again", seen[id(leaf)]))
                continue
            seen[id(leaf)] = k
            ptr = leaf.untyped_storage().data_ptr()
            i = by_storage.get(ptr) if ptr else None
            if not ((i is not None and leaf is inputs.leaves[i])
                    or (ptr in persistent_storages and id(leaf) in persistent_ids)):
                # (every action below but handing back the caller's own object makes a tensor
                # by an op)
                refuse_lost_kind(leaf)
            if leaf.numel() == 0 or not ptr:
                actions.append(clone_output(leaf))
            elif i is not None and inputs.same_layout.get(i, True):
                f = _view_of_input(i, leaf, inputs.leaves[i])
                actions.append(lambda leaves, outs, f=f: f(leaves))
            elif i is not None:
                # (its buffer is compact: a view of it, the buffer itself too, is not what
                # eager makes of the caller's tensor, ``x.contiguous()`` being the buffer)
                raise OutputPlanError(
                    f"forward returns argument {i}, which overlaps itself (an expand()), or a "
                    "tensor on its memory: the graph reads a compact copy of it, on which that "
                    "output is not the one eager makes of your tensor")
            elif ptr in persistent_storages:
                if id(leaf) in persistent_ids:  # the caller's own tensor, as eager returns it
                    actions.append(lambda leaves, outs, t=leaf: t)
                elif leaf._is_view() or leaf.is_inference():  # a view of it: a fresh view
                    actions.append(lambda leaves, outs, t=leaf: t.view_as(t))
                else:  # an alias autograd sees as no view (``w.detach()``, ``b.view(int32)``)
                    actions.append(lambda leaves, outs, t=leaf: t.detach())
            else:
                pool.setdefault(ptr, []).append(k)
                actions.append(("pool", leaf))
        elif kind == "arg":
            actions.append(lambda leaves, outs, i=leaf: leaves[i])
        else:
            actions.append(lambda leaves, outs, v=leaf: v)
    # Copies (``clone_output``): the outputs on one storage of the pool, or one a clone would
    # not give back as eager has it (strided, conj), are made again on one copy of the bytes
    # they reach, first on each call (``_Actions.spans``: ``outs`` starts with their lists)
    copies = {} if pool_output is not clone_output else {
        ptr: ks for ptr, ks in pool.items()
        if len(ks) > 1 or not clone_keeps(kinds[ks[0]][1])}
    spans = list(copies.values())
    base = len(spans) if len(actions) > 1 else 0  # (one output: its action makes its copy)
    for m, ks in enumerate(spans):
        ts = [kinds[k][1] for k in ks]
        odd = next((t for t in ts if not copyable(t)), None)
        if odd is not None:
            raise OutputPlanError(
                f"forward returns a {type(odd).__name__} that shares memory with another "
                "output or is strided: a replay's copy of it would not be eager's tensor")
        lo, hi = span_of(ts)
        make = functools.partial(_remake, span_view(ts[0], lo, hi), recipes(ts, lo))
        actions.spans.append(make)
        for j, k in enumerate(ks):
            if base:
                actions[k] = lambda leaves, outs, m=m, j=j: outs[m][j]
            else:
                fresh = lambda make=make: make()[0]  # noqa: E731
                actions[k] = f = lambda leaves, outs, fresh=fresh: fresh()
                f.fresh = fresh  # (as ``clone_output``'s)
    if not base:
        actions.spans.clear()
    for k, act in enumerate(actions):
        if type(act) is tuple:
            what, v = act
            actions[k] = pool_output(v, len(pool[v.untyped_storage().data_ptr()]) == 1) \
                if what == "pool" else (lambda leaves, outs, j=v + base: outs[j])
    return actions, spec


def _remake(span: torch.Tensor, hows: list[tuple]) -> list[torch.Tensor]:
    return rebuild(span.clone(), hows)


class _Actions(list):
    """An output plan's actions, in output order; ``spans``: what makes, once per call before
    them, the copies of the outputs of one storage (see ``plan_outputs``)."""

    def __init__(self):
        super().__init__()
        self.spans: list[Callable[[], list]] = []


class CapturedGraph(Owned):
    """A captured graph with its input and output plan. :meth:`run` is the replay fast path.

    ``hazard``: storages of static outputs the caller holds (``copy_outputs=False``) that a
    copy-back into a written input must not overwrite (the engine then runs that call eagerly).
    """

    hazard: frozenset | set = frozenset()
    # whether a replay may write memory of its pool beyond its outputs (its forward's
    # temporaries, its kernels' scratch): where it may, a graph captured after it into the
    # pool may lie there (see _region.GraphRegion.protect_before, _capturing._scratch)
    scratch = True
    # blocks handed out and freed on the device while it was captured (see _capture.RawGraph)
    allocs: int | None = None
    frees: int | None = None
    sets: tuple = ()  # module attributes its forward sets to a constant (_watch.set_again)
    trial = None  # a piece's graph being timed against its eager run (see _trial)
    # (calls its replay was blocked by a later graph's held output, its uses at the last of
    # them, and their thread: see _engine._replay)
    blocked = (0, -1, 0)
    # the recaptures in a row of the signature it was captured for, when released after a later
    # graph blocked it (see _engine._replay)
    row = 0

    def __init__(self, raw, inputs: StaticInputs, mutated: list[int], actions: list, spec,
                 keep: list, device: torch.device):
        self.raw = raw
        self.device = device
        self.owner = None  # the engine state that captured it
        self.seq: int | None = None  # capture order inside a graph_region (None outside)
        self.shared = False  # made from a share_graph template
        self.borrowed: list = []  # (leaf index, region slot) read in place from another graph
        self.on_release: list[Callable[[], None]] = []
        self.after_release: list[Callable[[], None]] = []  # run once released
        self.input_copies = 0
        self._replay = raw.replay
        # (a buffer two leaves share, one tensor passed twice, copied in once)
        self._copy_in = [(i, buf, buf.data_ptr()) for i, buf in _once(inputs.copy)]
        self._copy_back = [(i, buf) for i, buf in inputs.copy if i in set(mutated)]
        copied = {i for i, _ in inputs.copy}
        # Leaves read in place (marked static, or statics passed as arguments): their address
        # is the graph's.
        self.inplace = [(i, leaf.data_ptr()) for i, leaf in enumerate(inputs.leaves)
                        if isinstance(leaf, torch.Tensor) and i not in copied]
        self.mutated = list(mutated)
        self._actions = actions
        self._spans = getattr(actions, "spans", None) or None  # (see plan_outputs)
        # static outputs handed out without a copy (copy_outputs=False, a region's or a
        # piecewise plan's chained slot), and their addresses: the caller may resize one (an
        # ``out=`` of another size, ``resize_``), which moves the graph's own memory; a replay
        # would then write where no output reads (see ``handed_moved``)
        self.handed = [(t, t.data_ptr()) for t in map(_handed_static, actions)
                       if t is not None]
        self._spec = spec
        self._single = spec.is_leaf() and len(actions) == 1
        # the one output's own maker (a clone, or a new tensor on the static output)
        self._fresh = getattr(actions[0], "fresh", None) if self._single else None
        self._inputs = inputs
        self._keep = keep  # static outputs: owned here so the pool outlives nothing it needs

    @property
    def pool_bytes(self) -> int:
        return self.raw.pool_bytes if self.raw is not None else 0

    def handed_moved(self) -> bool:
        """Whether a static output handed out without a copy was moved by its caller. For
        good: the memory it left may be handed to a later capture of the pool, and an address
        that comes back by chance is no longer the graph's."""
        if all(t.data_ptr() == ptr for t, ptr in self.handed):
            return False
        self.handed = [(t, -1) for t, _ in self.handed]  # (no address is -1: never again)
        return True

    def copied_indices(self) -> list[int]:
        """The leaves copied into static buffers (not read in place)."""
        return [i for i, _, _ in self._copy_in]

    def output_tensors(self) -> list[torch.Tensor]:
        """The capture's output tensors (static outputs, or what they alias)."""
        return [t for t in pytree.tree_leaves(self._keep) if isinstance(t, torch.Tensor)]

    def static_leaves(self) -> list[torch.Tensor]:
        """The tensors the graph reads its inputs from (static buffers, or leaves in place)."""
        return [t for t in self._inputs.leaves if isinstance(t, torch.Tensor)] \
            if self._inputs is not None else []

    @property
    def capture_seconds(self) -> float:
        return self.raw.capture_seconds

    def run(self, leaves: list) -> Any:
        for i, buf, ptr in self._copy_in:
            x = leaves[i]
            if x.data_ptr() != ptr:
                buf.copy_(x)
                self.input_copies += 1
        self._replay()
        if self._copy_back:
            for i, buf in self._copy_back:
                leaves[i].copy_(buf)
        return self.outputs(leaves)

    def outputs(self, leaves: list) -> Any:
        """The call's outputs, after a replay (the plan made at capture)."""
        if self._fresh is not None:
            return self._fresh()
        if self._single:
            return self._actions[0](leaves, None)
        spans = self._spans
        outs: list = [make() for make in spans] if spans is not None else []
        for act in self._actions:
            outs.append(act(leaves, outs))
        if spans is not None:
            del outs[:len(spans)]
        return pytree.tree_unflatten(outs, self._spec)

    def release(self) -> None:
        for hook in self.on_release:
            hook()
        self.on_release = []
        after, self.after_release = self.after_release, []
        raw, self.raw = self.raw, None
        self._replay = None
        self.borrowed = []
        self._keep = []
        self._inputs = None
        self._copy_back = self._copy_in = []
        self._actions = []
        self._spans = None
        self.handed = []
        self._fresh = None
        if raw is not None:
            raw.release()
        for hook in after:  # (the graph's own references are gone now)
            hook()
