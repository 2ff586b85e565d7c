"""Review of be9264b (bucketed: a second change after a re-check refuses the size) and 7f1ab8c
(every held tensor copied for the extra warm-ups; only versions kept around the capture), on
the simulated backend.

helper-58's five findings were fixed after the review (each marked where its strict xfail was);
the rest are controls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from conftest import SimBackend
from cudagraphify import _capture
from test_share_engine import _distinct, _register, reading  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("quiet")


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# -- 7f1ab8c: only versions kept around the capture ------------------------------------------


class Hits(nn.Module):
    """Counts its calls in a plain tensor attribute (not a buffer), written in place."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hits = torch.zeros(n)

    def forward(self, x):
        self.hits.add_(1)
        return self.lin(x) + self.hits.sum()


@pytest.mark.parametrize("warmups", [1, 3])
def test_held_counter_graphify_control(sim, warmups):
    """No sharing: the extra warm-ups are undone and the capture runs no kernel."""
    torch.manual_seed(0)
    ref = Hits()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
            assert torch.equal(g.hits, ref.hits), (i, g.hits, ref.hits)


# (fixed: the tensors read from outside are put back by value around the capture too)
def test_share_graph_held_counter_written_by_checks(reading):
    torch.manual_seed(0)
    layers = _distinct(nn.ModuleList([Hits() for _ in range(3)]))
    ref = copy.deepcopy(layers)
    _register(*layers)
    cg.share_graph(layers)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(2, 4)
            for k, (layer, twin) in enumerate(zip(layers, ref)):
                layer(x), twin(x)
                assert torch.equal(layer.hits, twin.hits), (step, k, layer.hits, twin.hits)


class HostBackend(SimBackend):
    """The simulated backend, with ``host`` tensors standing for CPU tensors of a CUDA
    forward: a CUDA capture records device work only, host ops run for real, so what the
    capture's run writes in them stays written."""

    def __init__(self, host: list[torch.Tensor]):
        super().__init__()
        self.host = host

    def capture(self, fn, device, pool=None, keep_graph=False):
        after = []

        def run():
            out = fn()
            with torch._C._DisableTorchDispatch():
                after.extend(t.clone() for t in self.host)
            return out

        graph, out = super().capture(run, device, pool, keep_graph)
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            for t, v in zip(self.host, after):
                t.data.copy_(v)  # (the version is the capture's business: versions_kept)
        return graph, out


class HostCount(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = torch.zeros((), dtype=torch.long)  # a CPU step counter

    def forward(self, x):
        self.steps.add_(1)
        return self.lin(x)


# (fixed: the tensors read from outside are put back by value around the capture too)
def test_cpu_counter_written_by_capture():
    torch.manual_seed(0)
    m = HostCount()
    backend = HostBackend([m.steps])
    old = _capture.set_backend(backend)
    try:
        g = cg.graphify(m)
        with torch.no_grad():
            for i in range(3):
                g(torch.randn(2, 4))
                assert int(m.steps) == i + 1, (i, int(m.steps))
    finally:
        _capture.set_backend(old)


# -- be9264b: a second change after a re-check refuses the size ------------------------------


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.lin(x) * self.scale


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


def _bucketed(cls):
    torch.manual_seed(0)
    ref = cls().eval()
    g = cg.graphify(copy.deepcopy(ref))
    return ref, g, cg.bucketed(g, [4])


def test_eval_called_every_step_control(sim):
    """model.eval() (or train() then eval()) between calls that are all made in eval mode:
    the flags are the same at every call, the size stays padded."""
    ref, g, b = _bucketed(Dropped)
    with torch.no_grad():
        for i in range(6):
            g.train()
            g.eval()
            x = torch.randn(3, 4)
            assert close(b(x), ref(x)), i
    assert not b.refused
    assert b.padded_calls >= 4  # the check's two, then padded calls


# (fixed: a size remembers the states its check passed in; train and eval are keys apart)
def test_attribute_toggled_back_refuses_for_good(sim):
    ref, g, b = _bucketed(Scaled)
    with torch.no_grad():
        for scale in [1.0, 2.0, 1.0, 2.0, 1.0]:
            g.scale = ref.scale = scale
            x = torch.randn(3, 4)
            assert close(b(x), ref(x)), scale
    assert not b.refused, b.refused


# (fixed: a size remembers the states its check passed in; train and eval are keys apart)
def test_train_eval_calls_by_turns_refuse(sim):
    ref, g, b = _bucketed(Scaled)
    with torch.no_grad():
        for train in [False, True, False, True]:
            g.train(train)
            ref.train(train)
            x = torch.randn(3, 4)
            assert close(b(x), ref(x)), train
    assert not b.refused, b.refused


# (fixed: the module's training flag is in the key: the train-mode size is refused alone)
def test_one_train_call_refuses_eval_for_good(sim):
    ref, g, b = _bucketed(Dropped)
    with torch.no_grad():
        b(torch.randn(3, 4))  # checked in eval mode
        g.train()
        b(torch.randn(3, 4))  # checked again in train mode: dropout makes it fail
        g.eval()
        x = torch.randn(3, 4)
        padded = b.padded_calls
        assert close(b(x), ref(x))
    assert b.padded_calls == padded + 1  # the eval size still runs padded
    assert b.refused and all(key[-1] is True for key in b.refused), b.refused  # train's only


def test_changed_twice_then_interacting_rows_stay_right_control(sim):
    """The point of be9264b: once refused, rows that come to interact run unpadded."""

    class Center(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.mode = 0

        def forward(self, x):
            if self.mode == 2:
                x = x - x.mean(0, keepdim=True)
            return self.lin(x) * (1 + self.mode)

    torch.manual_seed(0)
    ref = Center().eval()
    g = cg.graphify(copy.deepcopy(ref))
    b = cg.bucketed(g, [4])
    with torch.no_grad():
        for mode in [0, 1, 2, 2]:
            g.mode = ref.mode = mode
            x = torch.randn(3, 4)
            assert close(b(x), ref(x)), mode
