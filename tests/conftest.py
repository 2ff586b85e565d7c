"""Test set-up: the ``cuda`` marker's skip rule, and a simulated capture backend for CPU tests.

The simulated backend lets the engine's bookkeeping (keys, capture/replay counts, static
buffers, output copies, invalidation, eviction) run on a CPU: "capture" runs the function once
to create the static outputs, "replay" runs it again on the static inputs and copies the results
into those same output tensors, as a real graph writes to fixed addresses. It is a test double
for the engine, not a substitute for the GPU tests.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import cudagraphify as cg
from cudagraphify import _capture
from cudagraphify._engine import _Nested
from cudagraphify._errors import CaptureFailed


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class SimGraph:
    def __init__(self, fn, static_out, backend):
        self._fn = fn
        self._static = [t for t in pytree.tree_leaves(static_out) if isinstance(t, torch.Tensor)]
        self.pool_bytes = sum(t.numel() * t.element_size() for t in self._static)
        self.pool = None
        self.capture_seconds = 0.001
        self._backend = backend
        self.released = False

    def replay(self):
        assert not self.released, "replay of a released graph"
        self._backend.replays += 1
        with _Nested():  # a real replay runs no Python: nested graphed calls must not see it
            out = self._fn()
        new = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for s, n in zip(self._static, new):
            if s.data_ptr() != n.data_ptr():
                s.copy_(n)

    def release(self):
        self.released = True
        self._static = []


class SimBackend:
    """Captures on the CPU device, by re-running the function (see the module docstring)."""

    def __init__(self):
        self.capturing = False
        self.captures = 0
        self.replays = 0
        self.warmups = 0
        self.graphs: list[SimGraph] = []

    def supports(self, device):
        return device.type == "cpu"

    def in_capture(self):
        return False

    def warmup(self, fn, device):
        self.warmups += 1
        return fn()

    def capture(self, fn, device, pool=None):
        self.capturing = True
        try:
            out = fn()
        except Exception as e:
            raise CaptureFailed(f"{type(e).__name__}: {e}") from e
        finally:
            self.capturing = False
        self.captures += 1
        g = SimGraph(fn, out, self)
        self.graphs.append(g)
        return g, out

    def new_pool(self, device):
        return None

    def stream_token(self, device):
        return 0

    def order_after(self, device, token):
        pass


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
def sim():
    backend = SimBackend()
    old = _capture.set_backend(backend)
    try:
        yield backend
    finally:
        _capture.set_backend(old)
