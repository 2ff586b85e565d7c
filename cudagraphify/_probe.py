"""The probe: which ops each submodule runs during a warm-up, and the piecewise plan from it.

While a :class:`Probe` is active (during warm-up and capture only, never on the replay path) a
``TorchFunctionMode`` sees every torch function and tensor method call, module forward hooks
keep the stack of running submodules, and the non-op calls a mode cannot see (syncs, seeding,
collectives) are wrapped. Each call is tagged by an :class:`~cudagraphify._policy.OpPolicy`;
calls it refuses become findings (module path, op, tags, file:line). :func:`plan_pieces` then
picks the largest submodules with no finding: they are graphed, the rest runs eagerly.
"""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.nn.modules import module as _module_mod
from torch.overrides import TorchFunctionMode

from ._watch import own_global_hook
from ._opinfo import W_FIRST, W_SCHEMA, info_of, infos, writes_unseen, written_by
from ._policy import ACCEL, NON_OP_CALLS, OpPolicy, _never_tagged, _untagged, op_name
from ._signature import storage_of
from ._writes import _swap_logs, holder, layout

__all__ = ["Finding", "Probe", "plan_pieces", "differing_paths"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_grad_enabled = torch.is_grad_enabled
# cudagraphify's own machinery; its reference models (bench/models.py) count as user code
_OWN_MODELS = os.path.join(_HERE, "bench", "models.py")
_HERE_DIR = os.path.join(_HERE, "")  # (with its separator: not ``<_HERE>_contrib/``)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class Finding:
    """A call the policy refused (or another reason a module is unsafe): where and why."""

    path: str  # module path inside the probed root ("" for the root itself)
    op: str
    tags: tuple[str, ...]
    where: str  # file:line of the user's code that made the call, or what happened instead
    file: str | None = None  # that file, relative to its project or site-packages
    line: int | None = None

    @classmethod
    def at_caller(cls, path: str, op: str, tags: tuple[str, ...]) -> "Finding":
        """A finding located at the user's code that made the call being recorded."""
        frame = _user_frame()
        if frame is None:
            return cls(path, op, tags, "?")
        return cls(path, op, tags, f"{frame[0]}:{frame[1]}", *frame)

    def __str__(self) -> str:
        tags = f" [{', '.join(self.tags)}]" if self.tags else ""
        return f"{self.op}{tags} at {self.where}"

    def to_dict(self) -> dict:
        """op, tags, file and line as fields (``detail`` where it has no file: control flow,
        a failed capture); ``text`` is ``str()``."""
        out = {"text": str(self), "op": self.op, "tags": list(self.tags), "file": self.file,
               "line": self.line}
        if self.file is None:
            out["detail"] = self.where
        return out


def own_file(filename: str) -> bool:
    """Whether ``filename`` is cudagraphify's own code (its reference models, bench/models.py,
    count as user code)."""
    return filename.startswith(_HERE_DIR) and filename != _OWN_MODELS


# the file name of graphify's call of a torch function the user graphified (see
# _wrap.user_call): the user's call, made from no file of theirs
USER_CALL_FILE = "<graphified "


def _user_frame() -> tuple[str, int] | None:
    """(file, line) of the innermost caller outside cudagraphify, torch and wrapt."""
    frame = sys._getframe(2)
    while frame is not None:
        f = frame.f_code.co_filename
        internal = own_file(f) or f.startswith(_TORCH) \
            or os.sep + "wrapt" + os.sep in f or f.startswith(USER_CALL_FILE)
        if not internal:
            return _relative(f), frame.f_lineno
        frame = frame.f_back
    return None


def _read_by_torch_or_us() -> bool:
    """Whether the code that made a read (the caller of the probe's hook, past torch's
    dispatch of Tensor methods) is torch's own or cudagraphify's."""
    frame = sys._getframe(3)
    while frame is not None and (frame.f_code.co_filename in _DISPATCH
                                 or frame.f_code is _NOTING_CODE):
        frame = frame.f_back
    if frame is None:
        return True
    f = frame.f_code.co_filename
    if f.startswith("<") and frame.f_back is not None:
        # code made at run time (``exec``: Triton's launcher binds its arguments so, reading
        # their ``data_ptr``): trusted where a trusted file called it (an ``exec``'d forward,
        # a notebook's, is called by torch's module call: its caller's caller decides nothing)
        caller = frame.f_back.f_code.co_filename
        return _TRITON is not None and caller.startswith(_TRITON)
    return f.startswith(_TRUSTED) or own_file(f)


_PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


@functools.lru_cache(maxsize=1024)
def _relative(filename: str) -> str:
    """``filename`` as a reader finds it: inside site-packages, from there
    (``transformers/models/llama/modeling_llama.py``); else from its project's root (the
    nearest folder with a pyproject.toml, setup.py, setup.cfg or .git); else its name."""
    path = os.path.abspath(filename)
    parts = path.split(os.sep)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("site-packages", "dist-packages"):
            return "/".join(parts[i + 1:])
    folder = os.path.dirname(path)
    while True:
        if any(os.path.exists(os.path.join(folder, m)) for m in _PROJECT_MARKERS):
            return os.path.relpath(path, folder).replace(os.sep, "/")
        parent = os.path.dirname(folder)
        if parent == folder:
            return os.path.basename(path)
        folder = parent


class _Mode(TorchFunctionMode):
    def __init__(self, probe: "Probe"):
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # (every torch call of a probed run comes here: the common case is kept inline)
        code = _getframe(1).f_code
        own = _own_codes.get(id(code))
        if own is None or own[0] is not code:
            own = _own_code(code)
        if own[1]:  # cudagraphify's own calls
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        probe = self.probe
        info = infos.get(id(func))
        if info is None or info[0] is not func:
            info = info_of(func)
        name = info[1]
        if probe.screens:
            if probe._fast and "record" not in probe.__dict__:  # (record, inlined)
                seq = probe._seq
                if seq is None:  # (the first op of this module since it was entered or left)
                    seq = probe._seq = probe.sequences[probe.path]
                seq.append(name)
                if probe.policy._overrides.get(func) is not None \
                        or not (_untagged.get(func) or _never_tagged(func)) \
                        or (kwargs and ("generator" in kwargs or "pin_memory" in kwargs)):
                    probe._screen(func, args, kwargs, name)
            else:
                probe.record(func, args, kwargs, name)
            if not probe.grad_on and _grad_enabled() and any(  # (an op, not a setter)
                    isinstance(a, torch.Tensor) or (isinstance(a, (list, tuple)) and any(
                        isinstance(b, torch.Tensor) for b in a)) for a in args):
                probe.grad_on = True
        layouts = None
        if probe.written is not None and (info[2] or kwargs):
            layouts = probe.note_writes(func, args, kwargs, info[2])
        if probe.saved is not None and writes_unseen(name):
            probe.save_reached(args, kwargs)
        if probe.layouts is not None:
            probe.note_layouts(args, kwargs)
        out = func(*args, **kwargs) if kwargs else func(*args)
        if name in GRAD_READS and probe.screens:
            probe.read_grad_state(name)
        if name in COPY_READS and probe.copied and probe.screens:
            probe.read_metadata(name, args)
        if out is not None and name in NODE_READS and probe.screens:
            # (a hook on an autograd node is a C method no patch reaches: the read is noted)
            from ._hooks import node_read
            caller = _getframe(1)
            if caller.f_code is _NOTING_CODE:  # (a property read through it: its caller's)
                caller = caller.f_back
            node_read(caller.f_code.co_filename)
        if layouts:
            probe.note_relayouts(layouts, name)
        if probe.known is not None:
            probe.note_tensors(func, args, kwargs, out)
        return out


# id(a code object) -> (it, whether it is cudagraphify's own: own_file of its file)
_own_codes: dict[int, tuple[Any, bool]] = {}
_getframe = sys._getframe


def _own_code(code: Any) -> tuple[Any, bool]:
    if len(_own_codes) >= 2048:
        _own_codes.clear()
    # (a property read through _noting_attributes is the user's read, made from there)
    hit = _own_codes[id(code)] = (code, own_file(code.co_filename)
                                  and code is not _NOTING_CODE)
    return hit


def _layout(t: torch.Tensor) -> tuple | None:
    """(storage address, shape, strides, offset) of ``t``; None where it has none of these
    (a sparse tensor, a wrapper subclass)."""
    try:
        return storage_of(t), t.shape, t.stride(), t.storage_offset()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


_resolved: dict[str, tuple[Any, str] | None] = {}


def _resolve(dotted: str) -> tuple[Any, str] | None:
    """(owner, attribute name) of a dotted name of :data:`NON_OP_CALLS` (None where it is not
    found), looked up once: each probe's entry wraps them all."""
    if dotted not in _resolved:
        _resolved[dotted] = _lookup(dotted)
    return _resolved[dotted]


def _lookup(dotted: str) -> tuple[Any, str] | None:
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:-1]:
                obj = getattr(obj, p)
            getattr(obj, parts[-1])
        except AttributeError:
            return None
        return obj, parts[-1]
    return None


CAPTURING_QUERY = "torch.cuda.is_current_stream_capturing"
NODE_READS = ("Tensor.grad_fn", "Tensor._grad_fn")  # (reads of a tensor's autograd node)
# reads of autograd's state of a tensor: its gradient (set by a backward or ``zero_grad``
# outside the call: neither the tensor nor whether there is one is the graph's), and whether it
# requires grad (``requires_grad_()`` between calls: see ``Probe.reads_requires_grad``)
GRAD_READS = frozenset({"Tensor.grad", "Tensor._grad", "Tensor.requires_grad", "Tensor.is_leaf",
                        "Tensor.is_inference"})
# reads of what a copied argument's static copy does not keep (its own storage, offset 0,
# aligned, no base, no node, its own version counter): a forward branching on one would replay
# the capture's branch for an argument that differs only there (see ``Probe.read_metadata``)
_ATEN_READS = ("storage_offset", "sym_storage_offset", "_version", "is_set_to", "output_nr")
COPY_READS = frozenset({
    "Tensor.storage_offset", "Tensor.data_ptr", "Tensor.const_data_ptr",
    "Tensor.untyped_storage", "Tensor.storage", "Tensor._version", "Tensor.is_shared",
    "Tensor._is_view", "Tensor._base", "Tensor.grad_fn", "Tensor._grad_fn", "Tensor.output_nr",
    "Tensor.is_set_to", "Tensor.__dlpack__", "Tensor.__cuda_array_interface__",
    # (the same through torch.ops.aten, as the probe names them)
    *(f"torch.{op}{overload}" for op in _ATEN_READS for overload in ("", ".default"))})
# of those, what a parameter's or buffer's guard (its address, layout, the object the module
# holds) does not cover: an in-place write (an optimizer's step) keeps its graphs
STATIC_READS = frozenset({"Tensor._version", "torch._version", "torch._version.default"})
# and what an argument read in place (a parameter passed in, one marked static) may differ in
# at the same address, layout and key: its version, and whether (and of what) it is a view
# (refused on that argument object: ``Probe.pinned``)
PINNED_READS = STATIC_READS | frozenset({
    "Tensor._is_view", "Tensor._base", "Tensor.grad_fn", "Tensor._grad_fn", "Tensor.output_nr",
    "torch.output_nr", "torch.output_nr.default"})
# torch's dispatch of a Python-level Tensor method, or of an op called through torch.ops, to
# the mode: not where a read is made
_DISPATCH = tuple(os.path.join(_TORCH, f) for f in ("overrides.py", "_tensor.py", "_ops.py"))
# readers whose reads of an argument's memory serve the kernels they launch (a capture
# launches them on the static copy, as the replay does): torch's own code, and Triton's
# launcher (its ``data_ptr() % 16`` picks the kernel specialised for that alignment)
def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)  # (found, not imported)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(os.path.abspath(spec.origin)) + os.sep


_TRITON = _package_dir("triton")
_TRUSTED = tuple(d for d in (_TORCH + os.sep, _TRITON) if d)
_active: dict[int, "Probe"] = {}  # thread id -> the probe recording on that thread
_patch_lock = threading.Lock()
_patch_users = 0
_patch_undo: list = []


def patch(owner: Any, attr: str, make: Callable[[Any], Any], undo: list) -> None:
    """``owner.attr`` replaced by ``make(owner.attr)``; what puts it back (the owner's own
    attribute, or none: an inherited one shows through again) appended to ``undo``."""
    own = attr in vars(owner)
    original = vars(owner)[attr] if own else None
    setattr(owner, attr, make(getattr(owner, attr)))
    undo.append(lambda: setattr(owner, attr, original) if own else delattr(owner, attr))


def _acquire_patches() -> None:
    """Wrap the non-op calls (once for all probes); each call goes to its thread's probe."""
    global _patch_users
    with _patch_lock:
        _patch_users += 1
        if _patch_users > 1:
            return
        for dotted, tags in NON_OP_CALLS.items():
            found = _resolve(dotted)
            if found is None:
                continue
            owner, attr = found

            def wrapping(_orig, _name=dotted, _tags=tags):
                def wrapper(*a, **k):
                    probe = _active.get(threading.get_ident())
                    if probe is None or probe._non_op_depth:
                        return _orig(*a, **k)  # another thread, or inside a recorded call
                    probe._record_non_op(_name, _tags)
                    if _name == CAPTURING_QUERY:
                        probe.askers.add(sys._getframe(1).f_globals.get("__name__", "?"))
                        if probe.rehearse:
                            return True  # a rehearsal of the capture: see Probe.rehearse
                    probe._non_op_depth += 1
                    try:
                        return _orig(*a, **k)
                    finally:
                        probe._non_op_depth -= 1
                return wrapper

            patch(owner, attr, wrapping, _patch_undo)
        # ``Tensor.set_``, which no torch function mode sees: a run beyond the real call that
        # rebinds a tensor from before the call (a global) before any op takes it notes its
        # layout there (``Probe.layouts``), to be put back
        patch(torch.Tensor, "set_", _noting_set, _patch_undo)
        # a Python attribute looked for on a tensor and missing (``getattr(x, "tag", None)``,
        # ``hasattr``), which no torch function mode sees either: on a copied argument, it is
        # refused (a later argument may have it, and the copy never does: Probe.read_metadata)
        if "__getattr__" not in vars(torch.Tensor):
            torch.Tensor.__getattr__ = _missing_attribute
            _patch_undo.append(lambda: delattr(torch.Tensor, "__getattr__"))


def _missing_attribute(self, name):
    probe = _active.get(threading.get_ident())
    if probe is not None and id(self) in probe.arguments and probe.screens \
            and not name.startswith("__") and not probe._tagging and not probe._non_op_depth:
        probe.read_attribute(name)
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_getattribute = object.__getattribute__
_attribute_users = 0


def _note_attributes(on: bool) -> None:
    """One more (``on``) or one fewer probe that needs :func:`_noting_attributes`: installed
    while any does (and ``Tensor`` has no ``__getattribute__`` of its own)."""
    global _attribute_users
    with _patch_lock:
        _attribute_users += 1 if on else -1
        mine = vars(torch.Tensor).get("__getattribute__") is _noting_attributes
        if _attribute_users == 1 and on and "__getattribute__" not in vars(torch.Tensor):
            torch.Tensor.__getattribute__ = _noting_attributes
        elif _attribute_users == 0 and mine:
            del torch.Tensor.__getattribute__


def _noting_attributes(self, name):
    """``Tensor.__getattribute__`` while a probe runs whose copied arguments carry Python
    attributes (rare: the cost, a Python call per attribute read of any tensor, is paid then
    only): a read of one of those, or of such an argument's ``__dict__``, is refused."""
    value = _getattribute(self, name)
    probe = _active.get(threading.get_ident())
    if probe is not None:
        names = probe.attributed.get(id(self))
        if names is not None and (name in names or name == "__dict__") and probe.screens \
                and not probe._tagging and not probe._non_op_depth:
            # (``__dict__`` read by torch's code too: ``Tensor.__deepcopy__`` hands the
            # attributes on to a new tensor, which the copy's would not have)
            probe.read_attribute(name, anyone=name == "__dict__")
    return value


_NOTING_CODE = _noting_attributes.__code__


def _noting_set(original):
    @functools.wraps(original)
    def set_(self, *args, **kwargs):
        probe = _active.get(threading.get_ident())
        if probe is not None and probe.layouts is not None and isinstance(self, torch.Tensor):
            if not own_file(sys._getframe(1).f_code.co_filename):
                probe.note_layouts((self,), {})
        return original(self, *args, **kwargs)
    return set_


def _release_patches() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0:
            while _patch_undo:
                _patch_undo.pop()()


class Probe:
    """Records ops per submodule of ``root`` while active (a context manager)."""

    def __init__(self, root: torch.nn.Module | None, policy: OpPolicy, *,
                 accel: frozenset = ACCEL, thunder: bool = False):
        self.policy = policy
        self.accel = accel
        self.thunder = thunder
        self.names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
        self.findings: list[Finding] = []
        # False: the ops are neither recorded nor tagged (no findings, no sequences): a probe
        # of what a run writes only (see _piecewise.write_tracker)
        self.screens = True
        self.sequences: dict[str, list[str]] = collections.defaultdict(list)
        self.called: set[str] = set()  # the submodules whose forward ran (ops of their own or not)
        self._stack: list[str] = []
        self._seq: list[str] | None = None  # sequences[path], while that module runs
        # the default policy's rules (no subclass's or instance's own), without Thunder:
        # record's shortcut
        self._plain = not thunder \
            and getattr(policy.tags, "__func__", None) is OpPolicy.tags \
            and getattr(policy.can_graph, "__func__", None) is OpPolicy.can_graph
        # record's shortcut inlined in the mode (no subclass's record, no policy's own
        # untagged_call; as defined here, not patched since, nor set on the instance)
        self._fast = self._plain and type(self).record is _RECORD \
            and getattr(policy.untagged_call, "__func__", None) is _UNTAGGED \
            and "untagged_call" not in vars(policy)
        self._undo: list = []
        self._non_op_depth = 0
        self._thread: int | None = None
        # modules (names) whose code asked torch.cuda.is_current_stream_capturing()
        self.askers: set[str] = set()
        # A rehearsal: an eager run on which that question is answered "yes", so that code
        # which takes another path while captured takes it here, where the probe sees it.
        self.rehearse = False
        # Tensors read that no op of this run made: ``known`` (storage addresses of the
        # arguments and statics, set by the caller to start tracking) and ``produced`` are
        # not outside memory; ``outside`` maps each other storage to where it was first read.
        self.known: set[int] | None = None
        self.produced: set[int] = set()
        self.outside: dict[int, Finding | None] = {}
        self.locate = True  # False: ``outside`` holds None for each (only its keys are wanted)
        # Storages written in place (set to a set to start tracking): version counters miss
        # writes made through another tensor object on the same memory (``x.data``, a view of
        # ``.data``, a detached alias).
        self.written: set[int] | None = None
        # those of them that no earlier op of the run produced (memory from before the call)
        self.written_before_made: set[int] = set()
        # a rehearsal's or an extra warm-up's (set to a dict to start, with ``written``):
        # storages from before the call, outside ``known``, by address -> (the storage, a copy
        # of its bytes before its first write in the run; None: put back by other means), put
        # back afterwards (see _rehearsal.rehearse, Capturing._extra_warmups)
        self.saved: dict[int, tuple | None] | None = None
        # storages never copied for a call that may write unseen (see save_reached): the
        # parameters' (a kernel launched with a weight's address reads it; a copy of each would
        # cost a copy of the model)
        self.weights: set[int] | frozenset = frozenset()
        # the host's memory only (a CUDA capture's run: it runs the host's work for real, and a
        # copy of the device's would be captured, not made)
        self.host_only = False
        # likewise (set to a dict to start, with ``written``): the tensors from before the call,
        # outside ``known``, that the run wrote in place, by id -> (the tensor, its version
        # before its first write in the run), put back afterwards (_writes.put_versions_back)
        self.versions: dict[int, tuple] | None = None
        # likewise (set to a dict to start): the tensors from before the call among its ops'
        # arguments, outside ``known``, by id -> (the tensor, its layout and version when first
        # seen), put back afterwards (_writes.put_seen_back): ``set_``, which no torch function
        # mode sees, may rebind one (a global's, on a path only later calls take; its own
        # first use noted by the patched ``set_``: see _acquire_patches)
        self.layouts: dict[int, tuple] | None = None
        # an op on tensors ran with grad mode on (a forward that turns it on itself, called
        # under no_grad: its signature's key holds no parameters' requires_grad, see
        # _first_call)
        self.grad_on = False
        # ``requires_grad`` of a tensor read under no_grad (a no_grad key holds no parameters'
        # requires_grad: a graph of it is checked against theirs at its capture, see
        # ``Owned.grads_read``)
        self.reads_requires_grad = False
        # the storages of the arguments a graph copies in, and of the statics (set by the first
        # call): a read of what a copy or a guard does not keep is refused (read_metadata)
        self.copied: set[int] | frozenset = frozenset()
        self.statics: set[int] | frozenset = frozenset()
        self.pinned: set[int] | frozenset = frozenset()  # (ids of arguments read in place)
        # ids of every tensor argument object of the call, copied or read in place: a Python
        # attribute looked up on one is refused (see _missing_attribute)
        self.arguments: set[int] | frozenset = frozenset()
        self._tagging = False  # (the policy's tags running: its attribute reads are its own)
        # id -> attribute names, of the tensor arguments that carry Python attributes: while
        # this probe runs, a read of one of them is refused (see _noting_attributes)
        self.attributed: dict[int, frozenset] = {}
        self.states_written: set[int] = set()  # a rehearsal's: its copies of static states
        # where ``written`` is tracked: the storages (as they are after the op) of tensors from
        # before the call whose layout an op changed (see note_relayouts)
        self.relaid: set[int] = set()
        self.made_empty: set[int] = set()  # ids of the run's tensors without memory
        self.made: set[int] = set()  # ids of the tensors its ops returned (written tracked)
        self.first_memory: list[Finding] = []  # those relayouts that gave an empty one memory
        self._relaid: dict[int, tuple] = {}  # id -> (tensor, layout before, where), in the run

    def ran(self) -> set[str]:
        """The module paths that ran: made ops of their own, or had their forward called."""
        return set(self.sequences) | self.called

    @property
    def path(self) -> str:
        return self._stack[-1] if self._stack else ""

    def record(self, func: Any, args: tuple, kwargs: dict, name: str | None = None) -> None:
        if name is None:
            name = op_name(func)
        seq = self._seq
        if seq is None:  # (the first op of this module since it was entered or left)
            seq = self._seq = self.sequences[self.path]
        seq.append(name)
        # the default policy's tags and can_graph, for the common case: a call no tag can
        # apply to is never refused (see OpPolicy.tags)
        if not self._plain or not self.policy.untagged_call(func, kwargs):
            self._screen(func, args, kwargs, name)

    def _screen(self, func: Any, args: tuple, kwargs: dict, name: str) -> None:
        """A recorded call's tags, and a finding where the policy refuses it."""
        if self._plain:
            tags = self.policy.tags(func, args, kwargs, accel=self.accel)
        else:
            key = None
            if self.thunder:
                key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor)
                            else repr(a) for a in args)
            self._tagging = True  # (Thunder's symbols look at the arguments' attributes)
            try:
                tags = self.policy.tags(func, args, kwargs, accel=self.accel,
                                        thunder=self.thunder, thunder_key=key)
            finally:
                self._tagging = False
        if not self.policy.can_graph(func, tags):  # asked about every call, tagged or not
            self.findings.append(Finding.at_caller(self.path, name, tuple(sorted(tags))))

    def note_writes(self, func: Any, args: tuple, kwargs: dict,
                    writes: int = W_SCHEMA) -> list[tuple[torch.Tensor, tuple | None]]:
        """Note the storages ``func`` writes: the first argument of an in-place op
        (``add_``, ``copy_``, ``__setitem__``, ``__iadd__``, ``inplace=True``), ``out=``, and
        what a custom op's schema declares written (``writes``: what
        :func:`~._opinfo.info_of` found; the default looks at everything). Returns each
        tensor written with its layout before the op (see :meth:`note_relayouts`)."""
        if kwargs or writes == W_SCHEMA:
            targets = written_by(func, args, kwargs)
        elif writes == W_FIRST and args:
            first = args[0]
            targets = first if isinstance(first, (list, tuple)) else (first,)
        else:
            return []
        written = self.written
        layouts = []
        for t in targets:
            if isinstance(t, torch.Tensor):
                ptr = storage_of(t)
                if ptr:
                    written.add(ptr)
                    if ptr not in self.produced:
                        self.written_before_made.add(ptr)
                        if self.saved is not None:
                            self._save(t, ptr)
                        if self.versions is not None \
                                and (self.known is None or ptr not in self.known) \
                                and not t.is_inference():
                            # (kept on the object that holds these contents once a run's
                            # swaps are swapped back: see _writes.holder)
                            h = holder(t) if _swap_logs else t
                            if id(h) not in self.versions:
                                self.versions[id(h)] = (h, t._version)
                layouts.append((t, _layout(t)))
        return layouts

    def save_reached(self, args: tuple, kwargs: dict) -> None:
        """Before a call that may write its tensor arguments unseen (running statistics
        updated in the kernel, memory handed past torch by ``data_ptr``: see
        :func:`~._opinfo.writes_unseen`): a copy of each from before the run, as of a first
        write (see ``saved``), the ``weights`` aside."""
        for value in (*args, *kwargs.values()) if kwargs else args:
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    ptr = storage_of(t)
                    if ptr and ptr not in self.produced and ptr not in self.weights:
                        self._save(t, ptr)

    def note_layouts(self, args: tuple, kwargs: dict) -> None:
        """Before an op: the layout and version of each tensor from before the call among its
        arguments, as first seen (see ``layouts``)."""
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, torch.Tensor):
                self._note_layout(value)
            elif isinstance(value, (list, tuple)):
                for t in value:
                    if isinstance(t, torch.Tensor):
                        self._note_layout(t)

    def _note_layout(self, t: torch.Tensor) -> None:
        h = holder(t) if _swap_logs else t  # (a run's swaps pending: see _writes.holder)
        layouts = self.layouts
        if id(h) in layouts:
            return
        if t.layout is not torch.strided or t.is_meta:  # (before any look at its storage)
            return
        ptr = storage_of(t)
        if ptr and ptr not in self.produced and (self.known is None or ptr not in self.known):
            lay = layout(t)
            if lay is not None:  # (an inference tensor has no version)
                layouts[id(h)] = (h, lay, None if t.is_inference() else t._version)

    def _save(self, t: torch.Tensor, ptr: int) -> None:
        """A copy of the bytes of ``t``'s storage (``ptr``) into ``saved``, unless it has one
        there (or None: put back by other means) or is ``known``."""
        saved = self.saved
        if ptr not in saved and (self.known is None or ptr not in self.known) \
                and (not self.host_only or t.device.type == "cpu"):
            st = t.untyped_storage()
            saved[ptr] = (st, st.clone())

    def note_relayouts(self, layouts: list[tuple[torch.Tensor, tuple | None]],
                       name: str) -> None:
        """After an op that wrote ``layouts``' tensors: one that changed the shape, strides,
        offset or memory of a tensor from before the call (``resize_``, an ``out=`` that
        grows it, ``t_``, ``unsqueeze_``; through a view of it too; not ``set_``, which no
        torch function mode sees) is a finding (RELAYOUT) where it differs at the run's end
        (:meth:`_settle_relayouts`): a replay changes no layout, and a CUDA capture's run
        would move that memory into the graph's pool without its bytes. The run's own tensors
        may change theirs."""
        for t, before in layouts:
            if before is None:
                continue
            now = _layout(t)
            if now == before:
                continue
            ptr = before[0]
            if ptr in self.produced or (not ptr and id(t) in self.made_empty):
                if now is not None and now[0]:
                    # memory a resize gave a tensor the run made (``torch.empty(0)``, no
                    # memory yet, then ``resize_``): the run's own, not read from outside
                    self.produced.add(now[0])
                continue
            if id(t) in self.made and t._is_view() and now is not None and now[0] == ptr:
                # (a view the run made changed its own layout: ``x.view(..).t_()``; a getter's
                # tensor from before the call, ``self.v._base``, is no view of its own)
                continue
            if id(t) not in self._relaid:  # (its layout before the call: its first change's)
                self._relaid[id(t)] = (t, before, Finding.at_caller(self.path, name,
                                                                    ("RELAYOUT",)))

    def _settle_relayouts(self) -> None:
        """At the run's end: the tensors from before the call whose layout differs from what
        it was (a forward that transposes its argument and back changed none)."""
        for t, before, finding in self._relaid.values():
            now = _layout(t)
            if now == before:
                continue
            if now is not None and now[0]:
                self.relaid.add(now[0])
            self.findings.append(finding)
            if not before[0]:  # (an empty tensor given memory: a workspace set up on first use?)
                self.first_memory.append(finding)
        self._relaid.clear()

    def note_tensors(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Note the storages ``func`` read that no earlier op of the run produced and that are
        not ``known``, and the storages it produced."""
        produced, known, outside = self.produced, self.known, self.outside
        inputs = []  # (an in-place or out= op returns its input: that object is not made)
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, torch.Tensor):
                inputs.append(value)
                ptr = storage_of(value)
                if ptr and ptr not in produced and ptr not in known and ptr not in outside:
                    self._read(func, value, ptr)
            elif isinstance(value, (list, tuple)):
                for t in value:
                    if isinstance(t, torch.Tensor):
                        inputs.append(t)
                        ptr = storage_of(t)
                        if ptr and ptr not in produced and ptr not in known \
                                and ptr not in outside:
                            self._read(func, t, ptr)
        if isinstance(out, torch.Tensor):
            self._made(out, inputs)
        elif isinstance(out, (list, tuple)):
            for value in out:
                if isinstance(value, torch.Tensor):
                    self._made(value, inputs)

    def _made(self, value: torch.Tensor, inputs: list) -> None:
        """``value`` is an op's result: noted as made by the run (see :meth:`note_tensors`)."""
        # (a view or alias of memory from before the call, ``x.data``, ``x[0]``, is not made
        # by the run: a write through it writes that memory)
        for t in inputs:
            if t is value:
                return
        if self.written is not None:
            self.made.add(id(value))  # (see note_relayouts)
        ptr = storage_of(value)
        if ptr and ptr not in self.known and ptr not in self.outside:
            self.produced.add(ptr)
        elif not ptr and not value._is_view():
            # (no memory yet: an op's empty output, not a view of an empty tensor from before
            # the call; see note_relayouts)
            self.made_empty.add(id(value))

    def _read(self, func: Any, t: torch.Tensor, ptr: int) -> None:
        """``t`` (storage ``ptr``) is read and comes from outside the run: noted where."""
        if not self.locate:
            self.outside[ptr] = None
            return
        shape = "nested" if t.is_nested else tuple(t.shape)  # (a nested one has no one shape)
        what = f"{shape} {str(t.dtype).replace('torch.', '')} tensor"
        self.outside[ptr] = Finding(self.path, op_name(func), ("OUTSIDE_TENSOR",),
                                    f"{_user_frame()} (reads a {what})")

    def read_grad_state(self, name: str) -> None:
        """The forward read a tensor's ``requires_grad``, or what the copy of an argument a
        graph reads does not keep (refused, a finding: ``.grad``, ``is_leaf``,
        ``is_inference()``)."""
        if name == "Tensor.requires_grad":
            if not _grad_enabled():
                self.reads_requires_grad = True
            return
        self.findings.append(Finding.at_caller(self.path, name, ("PYTHON_STATE",)))

    def watch_arguments(self, tensors: list, in_place: list[bool], statics: set[int]) -> None:
        """Set what :meth:`read_metadata` and :meth:`read_attribute` refuse for a call whose
        tensor leaves are ``tensors`` (``in_place``: each read in place, marked or named
        static, rather than copied; ``statics``: the storages of the parameters and buffers,
        whose own leaves are read in place too)."""
        ptrs = [storage_of(x) for x in tensors]
        pinned = [(x, p) for x, p, s in zip(tensors, ptrs, in_place) if s or p in statics]
        self.statics = statics | {p for _, p in pinned}
        self.pinned = {id(x) for x, _ in pinned}
        self.copied = {p for x, p in zip(tensors, ptrs) if id(x) not in self.pinned} \
            - self.statics - {0}
        # (the Python attributes they carry: the graph's copies carry none, and a later
        # argument, the same object or not, may carry others)
        self.arguments = {id(x) for x in tensors}
        self.attributed = {id(x): frozenset(d) for x in tensors
                           if (d := getattr(x, "__dict__", None))}

    def read_metadata(self, name: str, args: tuple) -> None:
        """The forward read ``name`` (:data:`COPY_READS`, or a Python attribute it did not
        find) of a tensor: refused (PYTHON_STATE) where that tensor's memory is a copied
        argument's (any of them), or a static's (a version, :data:`STATIC_READS`), and the read
        is made by code outside torch (torch's own, a full backward hook's ``grad_fn`` or an
        RNN's ``data_ptr`` of its weights, runs on every call as it did at capture)."""
        for t in args[:2]:  # (the tensor read; ``is_set_to``'s other one too)
            if not isinstance(t, torch.Tensor):
                continue
            ptr = storage_of(t)
            if ptr in self.copied or (name in STATIC_READS and ptr in self.statics) \
                    or (name in PINNED_READS and id(t) in self.pinned):
                break
        else:
            return
        if _read_by_torch_or_us():
            return
        self.findings.append(Finding.at_caller(self.path, name, ("PYTHON_STATE",)))

    def read_attribute(self, name: str, anyone: bool = False) -> None:
        """The forward looked up the Python attribute ``name`` of one of the call's tensor
        arguments (``arguments``: the graph's copy of it, or a later argument, may not have
        it, or have another): refused (PYTHON_STATE), unless torch's code (or ours) made the
        lookup and not ``anyone``."""
        if not anyone and _read_by_torch_or_us():
            return
        if anyone and own_file(sys._getframe(2).f_code.co_filename):
            return
        self.findings.append(Finding.at_caller(self.path, f"Tensor.{name}", ("PYTHON_STATE",)))

    def may_rehearse(self) -> bool:
        """Whether the code asked if it is being captured, and every place that asked is
        trusted to compute the same while captured (``OpPolicy.trusts_captured_path``)."""
        return bool(self.askers) and all(self.policy.trusts_captured_path(m)
                                         for m in self.askers)

    def _record_non_op(self, name: str, tags: tuple[str, ...]) -> None:
        self.sequences[self.path].append(name)
        self._seq = None
        own = self.policy.overrides(name)
        final = frozenset(own) if own is not None else frozenset(tags)
        if not self.policy.can_graph(name, final):
            self.findings.append(Finding.at_caller(self.path, name, tuple(sorted(final))))

    # Module hooks and the non-op wrappers are process-wide: only the probing thread counts.
    def _pre(self, module, args):
        name = self.names.get(id(module))
        if name is not None and threading.get_ident() == self._thread:
            self._stack.append(name)
            self._seq = None
            self.called.add(name)

    def _post(self, module, args, output):
        if self.names.get(id(module)) is not None and self._stack \
                and threading.get_ident() == self._thread:
            self._stack.pop()
            self._seq = None

    def __enter__(self) -> "Probe":
        self._thread = threading.get_ident()
        if self.names:
            for register, hook, kw in (
                    (_module_mod.register_module_forward_pre_hook, self._pre, {}),
                    (_module_mod.register_module_forward_hook, self._post,
                     {"always_call": True})):
                ctx = own_global_hook(register, hook, **kw)
                ctx.__enter__()
                self._undo.append(lambda ctx=ctx: ctx.__exit__(None, None, None))
        _acquire_patches()
        outer = _active.get(self._thread)
        _active[self._thread] = self
        self._undo.append(_release_patches)
        self._undo.append(lambda: _active.__setitem__(self._thread, outer) if outer is not None
                          else _active.pop(self._thread, None))
        if self.attributed:
            _note_attributes(True)
            self._undo.append(lambda: _note_attributes(False))
        mode = _Mode(self)
        mode.__enter__()
        self._undo.append(lambda: mode.__exit__(None, None, None))
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()
        self._stack.clear()
        self._seq = None
        if self._relaid:
            self._settle_relayouts()

    def unsafe_paths(self) -> dict[str, list[Finding]]:
        out: dict[str, list[Finding]] = collections.defaultdict(list)
        for f in self.findings:
            out[f.path].append(f)
        return dict(out)


# (as defined here: a patched Probe.record or OpPolicy.untagged_call takes the slow path)
_RECORD = Probe.record
_UNTAGGED = OpPolicy.untagged_call


def differing_paths(a: Probe, b: Probe) -> set[str]:
    """Module paths whose op sequence differs between two runs (data-dependent control flow)."""
    return {p for p in set(a.sequences) | set(b.sequences)
            if a.sequences.get(p) != b.sequences.get(p)}


def control_flow_findings(a: Probe, b: Probe, why: str) -> dict[str, Finding]:
    """A finding for each path whose op sequence differs between two runs, located at the
    first op where they part ("op 7 (aten.mul in the first run, aten.add in the second)")."""
    out = {}
    for p in differing_paths(a, b):
        s, t = a.sequences.get(p, []), b.sequences.get(p, [])
        i = next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t)))
        first, second = (seq[i] if i < len(seq) else "its end" if p in run.sequences
                         else "nothing (it did not run)" for seq, run in ((s, a), (t, b)))
        out[p] = Finding(p, "control flow", (),
                         f"op {i} ({first} in the first run, {second} in the second): {why}")
    return out


def _inside(path: str, other: str) -> bool:
    """True when ``other`` is ``path`` or one of its descendants."""
    return other == path or path == "" or other.startswith(path + ".")


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def plan_pieces(root: torch.nn.Module, unsafe: set[str], ran: set[str]) -> list[str]:
    """The largest submodules (paths) that ran and contain no unsafe path: graph these.

    An empty list with the root safe means: graph the whole root (``[""]``).
    """
    if not any(_inside("", u) for u in unsafe):
        return [""]
    pieces: list[str] = []

    def visit(path: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            p = f"{path}.{name}" if path else name
            if not any(_inside(p, r) for r in ran):
                continue  # never ran: nothing to graph
            if any(_inside(p, u) for u in unsafe) or isinstance(child, _CONTAINERS) \
                    or p not in ran:
                # (a container is never called: its members are; nor is a module whose
                # parent calls its children itself, ``self.attn.qkv(x)``)
                visit(p, child)
            else:
                pieces.append(p)

    visit("", root)
    return pieces
