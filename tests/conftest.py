"""Test set-up: the ``cuda`` marker's skip rule, and a simulated capture backend for CPU tests.

The simulated backend (``SimBackend``, fixture ``sim``) lets the engine run on a CPU and replays
what it captured, as a CUDA graph does, so a CPU test can catch a stale replay.

What it models:

- ``capture(fn)`` runs ``fn`` once under a ``TorchDispatchMode`` that records every aten op in
  order (the op, its arguments as they were, its outputs) and returns what ``fn`` returned. An
  exception in ``fn`` raises ``CaptureFailed``. Memory that existed before the capture and that
  it wrote (running statistics, an input written in place, a KV cache) is put back as it was
  afterwards: a CUDA capture runs no kernel. ``in_capture()`` is true on the capturing thread
  while ``fn`` runs. Autograd's backward runs on the calling thread on a CPU, so a captured
  ``torch.autograd.grad`` records the backward's ops too.
- Addresses: every tensor an op read or wrote is kept as a tensor made from its storage with the
  size, stride and offset it had then, and the storages are held (never freed under a graph).
  ``replay()`` runs the recorded ops on those, with no Python of the forward and no dispatch
  mode seeing them (inside another simulated capture they are recorded into it). A result that
  is not already in the recorded output's memory (a new tensor, rather than an in-place, out=,
  view or returned input) is copied there, so later ops and the tensors ``capture`` returned see
  it. So ``p.data = t``, a reassigned parameter or a smaller ``resize_`` after capture are not
  seen by a replay: it reads the memory it captured, with the captured layout.
- Scalars are the captured ones: a value the forward read from Python (``self.scale``, a flag,
  the path an ``if`` took) is frozen at capture. Python side effects happen once, at capture.
- Random ops draw new numbers on each replay (as a CUDA graph's advancing generator does).
- A replay runs outside grad mode and CPU autocast, whatever the caller has on (the graph's ops
  are the ones captured, casts included).

What it does not model, or only flags:

- An op with a non-tensor output (``.item()``, ``aten.equal``: a host sync a CUDA capture
  refuses) is recorded, and ``replay()`` of that graph raises an ``AssertionError`` naming it.
  An op whose result changes shape on replay (data-dependent shapes) raises one too.
- Memory that moved: a storage resized larger (or freed with ``untyped_storage().resize_(0)``)
  after capture. A CUDA graph would read the freed memory; the double cannot keep it, so
  ``replay()`` raises an ``AssertionError`` ("stale replay").
- Memory pools: every storage is kept alive, so no two tensors of a capture share memory that a
  caching allocator would have reused; ``pool_bytes`` is the bytes of storages first made by the
  capture, ``new_pool()`` returns None. Streams and their ordering are not modelled.
- Kernel choice and capture-time errors: an op that a CUDA capture forbids (a sync, an
  allocation on another stream) captures fine here; replays dispatch each op anew.
- Tensor subclasses with their own ``__torch_dispatch__`` are recorded at the subclass level.

It is a test double for the engine, not a substitute for the GPU tests.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import cudagraphify as cg
from cudagraphify import _capture, _segrun
from cudagraphify._errors import CaptureFailed


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _untimed_pieces(request, monkeypatch):
    """GPU tests count a piecewise plan's replays and eager calls exactly, which the timing of
    pieces against their eager runs (cudagraphify/_trial.py: a piece's first calls alternate,
    and a piece that does not pay is given back, by time) would make depend on the machine's
    speed: it is off, but in tests marked ``times_pieces`` (tests/test_gpu_trial.py)."""
    if "times_pieces" not in request.keywords:
        monkeypatch.setattr(_capture.CudaBackend, "clock", None)


class _Ref:
    """Where a recorded op's tensor was: an index into the graph's tensor specs."""

    __slots__ = ("spec", "fresh")

    def __init__(self, spec: int, fresh: bool):
        self.spec = spec  # index into SimGraph._specs
        self.fresh = fresh  # an argument the op returns (in place, out=): a new alias each replay


class _Recorder(TorchDispatchMode):
    """Records every aten op ``fn`` runs: the op, its arguments and outputs, tensors by memory."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []  # (func, args, kwargs, outputs) with tensors as _Ref
        # (holder, offset, size, stride, dtype, conj, neg): ``holder`` a tensor on the storage
        # (a CUDA graph holds no Python storage object, which a caller's ``untyped_storage()``
        # would share: see _holder)
        self.specs: list[tuple] = []
        self._index: dict[tuple, int] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}  # StorageImpl address -> storage
        self.fresh_storages: set[int] = set()  # first seen as an op's output: the "pool"
        self.unreplayable: list[str] = []  # ops whose outputs are not tensors (host syncs)
        # contents of memory that existed before the capture and that it wrote: a CUDA capture
        # runs no kernel, so the capture leaves it as it was (``restore``)
        self.saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def _spec(self, t: torch.Tensor, output: bool = False) -> _Ref:
        s = t.untyped_storage()
        if s._cdata not in self.storages:
            self.storages[s._cdata] = s
            if output:
                self.fresh_storages.add(s._cdata)
        key = (s._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.is_conj(),
               t.is_neg())
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self.specs)
            self.specs.append((_holder(s),) + key[1:])
        return _Ref(i, False)

    def _keep(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s._cdata not in self.fresh_storages and s._cdata not in self.saved:
            with torch._C._DisableTorchDispatch():
                self.saved[s._cdata] = (s, s.clone())

    def restore(self) -> None:
        """Put back what the capture wrote into memory it did not make."""
        with torch._C._DisableTorchDispatch():
            for s, copy in self.saved.values():
                s.copy_(copy)
        self.saved.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # arguments as they are when the op starts (an in-place op may change their metadata)
        before = pytree.tree_map_only(torch.Tensor, self._spec, (args, kwargs))
        # every op may write what it reads (BatchNorm updates its running statistics without
        # declaring it in its schema): keep what memory made before the capture held
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._keep(t)
        out = func(*args, **kwargs)
        returned = {id(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
        (a, kw) = pytree.tree_map(
            lambda r, v: _Ref(r.spec, id(v) in returned) if isinstance(r, _Ref) else r,
            before, (args, kwargs))
        outs = []
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                outs.append(self._spec(o, output=True))
            else:
                outs.append(None)
                if o is not None and str(func) not in self.unreplayable:
                    self.unreplayable.append(str(func))
        self.ops.append((func, a, kw, outs))
        return out


def _holder(storage: torch.UntypedStorage) -> torch.Tensor:
    """A tensor on ``storage``, to hold its memory without holding its Python object: PyTorch
    keeps one Python object per storage, the one a caller's ``untyped_storage()`` returns and
    whose references cudagraphify counts (a held storage object is a holder of the memory); a
    CUDA graph keeps none of them, nor must the double."""
    with torch._C._DisableTorchDispatch():  # no device work: no mode records it
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _alias(spec: tuple) -> torch.Tensor:
    """A tensor on the memory ``spec`` describes (made from its storage: whatever later happens
    to the Python tensor that was there, this one reads the memory the capture saw)."""
    holder, offset, size, stride, dtype, conj, neg = spec
    storage = holder.untyped_storage()
    with torch._C._DisableTorchDispatch():  # no device work: no mode records it
        t = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
    if conj:
        torch._C._set_conj(t, True)
    if neg:
        torch._C._set_neg(t, True)
    return t


class SimGraph:
    """A recorded op sequence replayed on the memory it was captured on (module docstring)."""

    def __init__(self, rec: _Recorder, backend: "SimBackend", pool=None,
                 capture_seconds: float = 0.0):
        self._backend = backend
        self.pool = pool
        self.capture_seconds = capture_seconds
        self.released = False
        self.unreplayable = list(rec.unreplayable)
        # the storages, held, and where their memory was when the capture ended: a replay must
        # find it there
        # (held by tensors on them, not by their Python objects: see _holder)
        self._memory = [(_holder(s), s.data_ptr(), s.nbytes()) for s in rec.storages.values()]
        self.pool_bytes = sum(rec.storages[k].nbytes() for k in rec.fresh_storages)
        # (the storages its ops made: what a CUDA capture's allocator hands out, _capture.RawGraph)
        # (tensors on them, as ``_memory``'s: ``h.untyped_storage()`` is the storage)
        self.fresh = [_holder(rec.storages[k]) for k in rec.fresh_storages]
        self._specs = rec.specs
        with torch.no_grad(), torch.inference_mode(False):
            self._aliases = [_alias(spec) for spec in rec.specs]
        self._ops = rec.ops
        # the output leaves of each op: an alias to write the result into (None: not a tensor)
        self._outs = [[None if r is None else self._aliases[r.spec] for r in outs]
                      for _, _, _, outs in rec.ops]

    def _arg(self, v):
        if not isinstance(v, _Ref):
            return v
        return _alias(self._specs[v.spec]) if v.fresh else self._aliases[v.spec]

    def replay(self):
        assert not self.released, "replay of a released graph"
        assert not self.unreplayable, (
            f"the graph holds op(s) with non-tensor outputs, which a replay cannot reproduce "
            f"(a host sync that a CUDA capture would refuse): {', '.join(self.unreplayable)}")
        for h, ptr, nbytes in self._memory:
            s = h.untyped_storage()
            assert s.data_ptr() == ptr and s.nbytes() >= nbytes, (
                f"stale replay: a storage the graph reads ({nbytes} bytes) was resized or freed "
                "after capture; a CUDA graph would read the freed memory")
        self._backend.replays += 1
        # No Python of the forward runs, and modes around the caller do not see the ops (a CUDA
        # replay is one launch); inside another simulated capture they are recorded into it.
        hide = contextlib.nullcontext() if self._backend.capturing \
            else torch._C._DisableTorchDispatch()
        with torch.no_grad(), torch.autocast("cpu", enabled=False), hide:
            for (func, args, kwargs, _), outs in zip(self._ops, self._outs):
                a, kw = pytree.tree_map(self._arg, (args, kwargs))
                result = func(*a, **kw)
                for alias, r in zip(outs, pytree.tree_leaves(result)):
                    if alias is None or alias.numel() == 0:
                        continue
                    assert r.shape == alias.shape, (
                        f"{func} gave a {tuple(r.shape)} result on replay, {tuple(alias.shape)} "
                        "at capture (a data-dependent shape: a host sync on CUDA)")
                    if r.untyped_storage().data_ptr() != alias.untyped_storage().data_ptr():
                        alias.copy_(r)

    def release(self):
        self.released = True
        self._ops, self._outs, self._aliases, self._specs, self._memory = [], [], [], [], []
        self.fresh = []


class SimBackend:
    """Captures on the CPU device by recording aten ops (see the module docstring)."""

    graph_class = SimGraph  # what capture() makes (a test double may make a subclass)

    def __init__(self):
        self._tls = threading.local()
        self.captures = 0
        self.replays = 0
        self.warmups = 0
        self.graphs: list[SimGraph] = []

    @property
    def capturing(self) -> bool:
        """True while this thread runs a capture's function."""
        return getattr(self._tls, "depth", 0) > 0

    def supports(self, device):
        return device.type == "cpu"

    def in_capture(self):
        return self.capturing

    def warmup(self, fn, device, on_side=True):
        self.warmups += 1
        return fn()

    def capture(self, fn, device, pool=None, keep_graph=False):
        rec = _Recorder()
        self._tls.depth = getattr(self._tls, "depth", 0) + 1
        t0 = time.perf_counter()
        try:
            with rec:
                out = fn()
        except Exception as e:
            raise CaptureFailed(f"{type(e).__name__}: {e}") from e
        finally:
            self._tls.depth -= 1
            rec.restore()
        self.captures += 1
        g = self.graph_class(rec, self, pool, time.perf_counter() - t0)
        self.graphs.append(g)
        return g, out

    def new_pool(self, device):
        return None

    def stream_token(self, device):
        return 0

    def order_after(self, device, token):
        pass


@pytest.fixture
def quiet():
    """cudagraphify's eager-fallback warnings off (CPU tests that expect fallbacks)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield


@pytest.fixture
def quiet_gpu():
    """GPU tests: cudagraphify's eager-fallback warnings off; all GPU work done afterwards."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield
    torch.cuda.synchronize()


@contextlib.contextmanager
def contexts(*ctxs):
    """Several context managers entered as one (for step tables that hold one factory)."""
    with contextlib.ExitStack() as stack:
        for c in ctxs:
            stack.enter_context(c)
        yield


def assert_chain_matches(layers, ref, x) -> None:
    """Each layer of ``layers`` applied in turn gives exactly what ``ref``'s layers give."""
    y, want = x, x
    for layer, r in zip(layers, ref):
        y, want = layer(y), r(want)
    torch.testing.assert_close(y, want, rtol=0, atol=0)


@pytest.fixture
def slot_moves(monkeypatch):
    """A Counter of the region slots' aliases moved to copies (``_region.Slot.move``), by the
    capture order of the slot's graph."""
    import collections
    from cudagraphify import _region
    moves = collections.Counter()
    move = _region.Slot.move

    def counting(slot, extra):
        moves[slot.seq] += 1
        return move(slot, extra)
    monkeypatch.setattr(_region.Slot, "move", counting)
    return moves


@pytest.fixture
def sim():
    backend = SimBackend()
    old = _capture.set_backend(backend)
    try:
        yield backend
    finally:
        _capture.set_backend(old)


@pytest.fixture
def sim_rng(sim, monkeypatch):
    """The simulated backend with a capture that draws no random numbers, as a CUDA capture
    draws none (the double's capture runs its ops for real: its draws are put back)."""
    real = sim.capture

    def capture(fn, device, pool=None, keep_graph=False):
        state = torch.random.get_rng_state()
        try:
            return real(fn, device, pool, keep_graph)
        finally:
            torch.random.set_rng_state(state)

    monkeypatch.setattr(sim, "capture", capture)
    return sim


@pytest.fixture
def segments_enabled():
    """Segments (``cudagraphify._segrun``, experimental: off by default) on for one test."""
    old = _segrun.ENABLED
    _segrun.ENABLED = True
    try:
        yield
    finally:
        _segrun.ENABLED = old


@pytest.fixture
def segments(sim, segments_enabled):
    """Segments on, over the CPU double (the ``sim`` backend)."""
    return sim
