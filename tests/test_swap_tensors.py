"""``torch.utils.swap_tensors`` in a forward (CPU, on the ``sim`` double of conftest.py, whose
capture runs the forward).

A swap changes which contents a Python tensor object holds: no op the probe sees, no version a
guard reads. The runs beyond a signature's real call (extra warm-ups, rehearsals, the capture)
must leave no swap behind, and a forward that swaps on those runs swaps on every later call,
which a replay does not: such a signature gets no whole graph. Each test compares the tensors
the user sees with eager PyTorch's after every call."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg

from test_warmups import _twins

_SWAP = torch._C._swap_tensor_impl
_G: dict = {}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Swapper(nn.Module):
    """Swaps its global ``target`` with a tensor computed from the output: on every call
    (``when="always"``), only on its first (``"first"``), or on all but its first (``"later"``).
    ``local``: swaps two tensors of its own instead (nothing the user sees)."""

    def __init__(self, when: str = "always", local: bool = False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.when, self.local, self.calls = when, local, 0
        _G[id(self)] = torch.zeros(4)

    def target(self) -> torch.Tensor:
        return _G[id(self)]

    def forward(self, x):
        h = self.lin(x)
        n, self.calls = self.calls, self.calls + 1  # (a Python counter: see _twins' runs)
        swap = {"always": True, "first": n == 0, "later": n > 0}[self.when]
        if swap:
            new = (h[0] * 2).detach().clone()
            if self.local:
                torch.utils.swap_tensors(torch.zeros(4), new)
            else:
                torch.utils.swap_tensors(_G[id(self)], new)
        return h * 3


def _run(model_when, probe, mode, calls=4, **kw):
    ref, g = _twins(lambda: Swapper(model_when, **kw), probe=probe)
    # (the Python counter is not what is compared: graphify's runs beyond the real call, and the
    # counter's write refusing a graph, are its business; the model's are put back by it)
    ctx = torch.no_grad if mode == "no_grad" else torch.enable_grad
    for i in range(calls):
        x = torch.randn(3, 4)
        with ctx():
            want, got = ref(x), g(x)
        assert torch.equal(got, want), i
        assert torch.equal(g.target(), ref.target()), (i, g.target(), ref.target())
    assert torch._C._swap_tensor_impl is _SWAP  # (the patch is gone)
    return ref, g


@pytest.mark.parametrize("probe", ["auto", False])
@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_a_global_swapped_on_every_call_is_swapped_on_every_call(sim, probe, mode):
    _run("always", probe, mode)


@pytest.mark.parametrize("probe", ["auto", False])
@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_a_global_swapped_on_later_calls_only(sim, probe, mode):
    _run("later", probe, mode)


@pytest.mark.parametrize("probe", ["auto", False])
def test_a_global_swapped_on_the_first_call_only(sim, probe):
    _run("first", probe, "no_grad")


class EveryCall(nn.Module):
    """Swaps its global on every call, with no Python state of its own (no counter: nothing
    else refuses its graph)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _G[id(self)] = torch.zeros(4)

    def target(self) -> torch.Tensor:
        return _G[id(self)]

    def forward(self, x):
        h = self.lin(x)
        torch.utils.swap_tensors(_G[id(self)], (h[0] * 2).detach().clone())
        return h * 3


@pytest.mark.parametrize("probe", ["auto", False])
@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_the_swap_refuses_the_graph_and_names_it(sim, probe, mode):
    ref, g = _twins(EveryCall, probe=probe)
    ctx = torch.no_grad if mode == "no_grad" else torch.enable_grad
    for i in range(4):
        x = torch.randn(3, 4)
        with ctx():
            want, got = ref(x), g(x)
        assert torch.equal(got, want), i
        assert torch.equal(g.target(), ref.target()), i
    s = cg.stats(g)
    # (no whole graph: eager, or piecewise where the probe can plan pieces, ``lin`` graphed)
    assert any("swap_tensors" in r for r in s.eager_calls), dict(s.eager_calls)
    assert sum(s.eager_calls.values()) == 4, dict(s.eager_calls)
    assert torch._C._swap_tensor_impl is _SWAP


def test_a_swap_in_the_real_call_only_stays_and_the_graph_replays(sim):
    # the user's own call swapped it: that stays; the runs after swap nothing, so the graph
    # stands and replays
    class FirstOnly(EveryCall):
        def __init__(self):
            super().__init__()
            self.done = False

        def forward(self, x):
            h = self.lin(x)
            if not self.done:
                torch.utils.swap_tensors(_G[id(self)], (h[0] * 2).detach().clone())
            return h * 3

    ref, g = _twins(FirstOnly)
    for i in range(4):
        x = torch.randn(3, 4)
        with torch.no_grad():
            want, got = ref(x), g(x)
            if i == 0:  # (after the first call; a plain attribute, set alike on both)
                ref.done = g.done = True
        assert torch.equal(got, want), i
        assert torch.equal(g.target(), ref.target()), i
    assert cg.stats(g).replays >= 1


def test_a_swap_of_the_runs_own_tensors_refuses_too_and_is_correct(sim):
    # (conservative: which tensors are from before the call is not asked; values equal)
    class Local(EveryCall):
        def forward(self, x):
            h = self.lin(x)
            a, b = torch.zeros(4), (h[0] * 2).detach().clone()
            torch.utils.swap_tensors(a, b)
            return h * 3 + a.sum()

    ref, g = _twins(Local)
    for i in range(3):
        x = torch.randn(3, 4)
        with torch.no_grad():
            assert torch.equal(g(x), ref(x)), i
    assert any("swap_tensors" in r for r in cg.stats(g).eager_calls)


def test_another_threads_swap_meanwhile_is_its_own(sim):
    # a first call's watch holds the patch; another thread's swap goes straight through and
    # stays (noted by no watch of its thread)
    at, go = threading.Event(), threading.Event()

    class Paused(EveryCall):
        def forward(self, x):
            h = self.lin(x)
            if not getattr(self, "paused", False):
                self.paused = True
            elif not getattr(self, "released", False):
                self.released = True
                at.set()
                assert go.wait(10)
            return h * 3

    g = cg.graphify(Paused())
    errors = []

    def first_call():
        try:
            with torch.no_grad():
                g(torch.randn(3, 4))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=first_call)
    th.start()
    try:
        assert at.wait(10), "the first call's later run never started"
        a, b = torch.zeros(2), torch.ones(2)
        torch.utils.swap_tensors(a, b)
    finally:
        go.set()
        th.join(10)
    assert not errors, errors
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.zeros(2))
    assert torch._C._swap_tensor_impl is _SWAP


def test_share_graphs_put_back_of_a_cache_lands_in_the_callers_tensor_after_a_swap():
    """A share_graph group's runs write a layer's part of a KV cache and put its bytes back
    afterwards (``_share._bytes_kept``). A run that swapped that cache tensor's contents with
    another tensor is swapped back first: the bytes go back into what the caller's object holds
    (before, they went into the swapped-in tensor, and the cache kept the run's writes)."""
    from cudagraphify import _share, _writes

    cache, other = torch.zeros(4), torch.full((4,), 7.0)
    log = _writes.open_swap_log()
    try:
        with _share._bytes_kept([cache]):
            cache.add_(1.0)  # the run writes the cache ...
            torch.utils.swap_tensors(cache, other)  # ... then swaps it
            _writes.note_swap(cache, other)  # (what the watch's patch notes)
            assert torch.equal(cache, torch.full((4,), 7.0))
        assert not log.pending
    finally:
        _writes.close_swap_log(log)
    assert torch.equal(cache, torch.zeros(4)), cache  # what it held before the run
    assert torch.equal(other, torch.full((4,), 7.0))  # and the other tensor is untouched
    assert not _writes._swap_logs
