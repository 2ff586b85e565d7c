"""GPU: ``torch.utils.swap_tensors`` in a forward (see tests/test_swap_tensors.py). A global swapped
by the runs beyond the real call (the capture's) is left as eager leaves it; a forward that swaps
on every call gets no whole graph, its other work graphed where the probe can plan pieces; every
output and the global are compared with eager's after each call, bitwise."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"
_G: dict = {}


class Swaps(nn.Module):
    """Swaps a CUDA global with a tensor made from its output: on every call, or (``later``)
    on every call after its first (whose real call sets the flag: the capture's run swaps)."""

    def __init__(self, later: bool):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.later, self.ready = later, False
        _G[id(self)] = torch.zeros(16, device=DEV)

    def target(self) -> torch.Tensor:
        return _G[id(self)]

    def forward(self, x):
        h = self.lin(x)
        if not self.later or self.ready:
            torch.utils.swap_tensors(_G[id(self)], (h[0] * 2).detach().clone())
        if not self.ready:
            self.ready = True
        return torch.relu(h) * 3


@pytest.mark.parametrize("later", [False, True])
@pytest.mark.parametrize("probe", ["auto", False])
def test_a_swapped_global_is_as_eager_leaves_it_after_every_call(later, probe):
    torch.manual_seed(0)
    ref = Swaps(later).to(DEV)
    g = cg.graphify(copy.deepcopy(ref), probe=probe)
    _G[id(g)] = _G[id(ref)].clone()
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(4, 16, device=DEV)
            want, got = ref(x), g(x)
            assert torch.equal(got, want), i
            assert torch.equal(g.target(), ref.target()), (i, g.target(), ref.target())
    s = cg.stats(g)
    # no whole graph: every call eager, or piecewise (``lin`` graphed) where the probe plans
    # pieces (with it, a path beyond the first call may be told apart first: control flow);
    # without the probe, the swap alone refuses it
    assert sum(s.eager_calls.values()) == 5, s
    if probe is False:
        assert any("swap_tensors" in r for r in s.eager_calls), s
