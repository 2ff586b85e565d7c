"""Review of branch fix-writes (the runs beyond the real call put back what they write).

CPU, ``sim``. Open findings are strict xfails; fixed ones and controls are plain tests."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg

from test_warmups import _same_as_eager, _twins, host_sim  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


_G: dict[int, torch.Tensor] = {}


class _SharedStore(nn.Module):
    """Buffer ``a`` and a global ``g`` are views of one storage. The real call writes ``a``;
    the later calls (extra warm-ups, capture) write ``g`` instead: one op either way."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        store = torch.zeros(12)
        self.register_buffer("a", store[:4])
        _G[id(self)] = store[4:8]
        self.ready = False

    def target(self):
        return _G[id(self)]

    def forward(self, x):
        t = _G[id(self)] if self.ready else self.a
        with torch.no_grad():
            t.add_(0.5)
        self.ready = True
        return self.lin(x) * self.a


# (finding 1, fixed: a storage a written static shares was never copied; only the static's
# own elements were put back, a later-path write to another part of it was kept)
@pytest.mark.parametrize("iters", [2, 3])
def test_global_view_sharing_a_written_buffers_storage(sim, iters):
    ref, g = _twins(_SharedStore, num_warmup_iters=iters)
    _same_as_eager(ref, g)


class _SharedStoreParam(_SharedStore):
    """As above, a buffer that is a view of a larger storage whose other part is a plain
    attribute (held) -- the held tensors are put back by ``kept``."""

    def __init__(self):
        super().__init__()
        self.other = _G.pop(id(self))

    def target(self):
        return self.other

    def forward(self, x):
        t = self.other if self.ready else self.a
        with torch.no_grad():
            t.add_(0.5)
        self.ready = True
        return self.lin(x) * self.a


@pytest.mark.parametrize("iters", [2, 3])
def test_plain_attribute_view_sharing_a_written_buffers_storage(sim, iters):
    ref, g = _twins(_SharedStoreParam, num_warmup_iters=iters)
    _same_as_eager(ref, g)


class _LaterResizeGlobal(nn.Module):
    """The later calls grow a global by ``resize_`` (a probe sees it) and fill it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _G[id(self)] = torch.zeros(4)
        self.ready = False

    def target(self):
        return _G[id(self)]

    def forward(self, x):
        g = _G[id(self)]
        with torch.no_grad():
            if self.ready:
                g.resize_(8)
                g.fill_(1.0)
            else:
                g.add_(0.0)
        self.ready = True
        return self.lin(x)


def _first_call_same(ref, g, iters_shape=(3, 4)):
    x = torch.randn(*iters_shape)
    with torch.no_grad():
        a, b = ref(x), g(x)
    assert torch.equal(a, b)
    return a, b


def test_control_global_resized_only_by_later_calls(sim):
    ref, g = _twins(_LaterResizeGlobal, num_warmup_iters=2)
    _first_call_same(ref, g)
    assert g.target().shape == ref.target().shape, (g.target(), ref.target())
    assert torch.equal(g.target(), ref.target())


class _KeepsOutput(nn.Module):
    """Keeps its output; the later calls zero the kept one (the user's output of call 1)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.last = None

    def forward(self, x):
        if self.last is not None:
            with torch.no_grad():
                self.last.mul_(0.5)
        out = self.lin(x)
        self.last = out
        return out


@pytest.mark.parametrize("iters", [2, 3])
def test_control_the_real_calls_output_written_by_later_calls(sim, iters):
    ref, g = _twins(_KeepsOutput, num_warmup_iters=iters)
    x = torch.randn(3, 4)
    with torch.no_grad():
        a, b = ref(x), g(x)
    assert torch.equal(a, b), (a, b)
    assert a._version == b._version, (a._version, b._version)
    assert g.last is b


class _LaterGlobalProbeOff(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _G[id(self)] = torch.zeros(4)
        self.ready = False

    def target(self):
        return _G[id(self)]

    def forward(self, x):
        with torch.no_grad():
            if self.ready:
                _G[id(self)].add_(0.5)
            else:
                self.lin.weight.add_(0.0)
        self.ready = True
        return self.lin(x)


@pytest.mark.xfail(strict=True, reason="finding (older; probe=False limitation): a global only "
                   "later calls write keeps the extra warm-ups' writes, silently")
def test_probe_off_global_only_later_calls_write(sim):
    ref, g = _twins(_LaterGlobalProbeOff, num_warmup_iters=2, probe=False)
    _first_call_same(ref, g)
    assert torch.equal(g.target(), ref.target()), (g.target(), ref.target())


class _LaterSetGlobal(nn.Module):
    """The later calls rebind a global's memory by ``set_`` (which no torch function mode
    sees); the first call does not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _G[id(self)] = torch.zeros(4)
        self.ready = False

    def target(self):
        return _G[id(self)]

    def forward(self, x):
        h = self.lin(x)
        if self.ready:
            _G[id(self)].set_(torch.cat([_G[id(self)], h[0].detach()]))
        self.ready = True
        return h


# (finding 3, fixed: a global's layout changed by set_ in an extra warm-up stayed changed, only
# statics' layouts were kept; the layouts of the tensors the runs' ops take are put back now)
def test_global_set_only_by_later_calls(sim):
    ref, g = _twins(_LaterSetGlobal, num_warmup_iters=2)
    _first_call_same(ref, g)
    assert g.target().shape == ref.target().shape, (g.target().shape, ref.target().shape)


class _GradHook(nn.Module):
    """A hook on the hidden activation's gradient adds into buffer ``gsum`` and a global: only
    backwards write them (the user's, and an extra warm-up's backward)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("gsum", torch.zeros(()))
        _G[id(self)] = torch.zeros(())

    def target(self):
        return _G[id(self)]

    def forward(self, x):
        h = self.lin(x)
        if h.requires_grad:
            def hook(g):
                with torch.no_grad():
                    self.gsum.add_(g.sum())
                    _G[id(self)].add_(1)
            h.register_hook(hook)
        return h * 2


# (finding 2, fixed: the capture's run of the backward wrote the global through the hook; its
# version was not put back, forward-time writes' were. Such a graph is refused now: see
# tests/test_warmups_backward.py)
def test_grad_hook_written_only_by_backwards_version(sim):
    ref, g = _twins(_GradHook)
    _same_as_eager(ref, g, grad=True)


# (finding 2, fixed: the capture's backward moved the version of a global an earlier user
# graph saved; its backward then raised where eager's does not)
def test_grad_hook_capture_version_breaks_users_saved_graph(sim):
    ref, g = _twins(_GradHook)
    for m in (ref, g):
        w = torch.ones((), requires_grad=True)
        z = w * m.target()  # (saves the global, at its version now)
        m(torch.randn(3, 4))  # (the first call: forward only)
        z.backward()  # eager: fine


# (finding 2, fixed: a host tensor a backward hook wrote during the capture's run, CUDA's host
# behaviour, was not put back: after the first forward the buffer and global differed)
def test_grad_hook_host_capture_writes_values(host_sim):
    ref, g = _twins(_GradHook)
    x = torch.randn(3, 4)
    ref(x), g(x)
    assert torch.equal(ref.gsum, g.gsum), (ref.gsum, g.gsum)
    assert torch.equal(ref.target(), g.target()), (ref.target(), g.target())
