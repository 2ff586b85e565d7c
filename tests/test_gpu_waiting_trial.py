"""GPU: a piece's training graph whose trial waits behind its own backward (a grad-mode forward
whose output stays referenced, no backward: the differential bench's grad-mode step) is kept on
what it timed and a second training graph of the signature replays beside it
(``_engine._settle_waiting_trials``). Every output compared with eager's bitwise, the gradients
of a later backward within the training tolerance; counters show the second graph replayed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"
TOL = dict(rtol=2e-5, atol=2e-6)


class Chain(nn.Module):
    """Forty small elementwise ops and a Linear: launch-bound, its graph clearly pays."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        h = self.lin(x)
        for k in range(20):
            h = torch.tanh(h) * (1.0 + 0.01 * k)
        return h


class Root(nn.Module):
    """A host sync between two pieces: the root runs piecewise."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Chain(), Chain()

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):  # a host sync
            y = y + 1
        return self.b(y)


def test_a_kept_output_lets_a_second_training_graph_replay():
    torch.manual_seed(0)
    ref = Root().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    gen = torch.Generator(device=DEV).manual_seed(1)

    def step():
        x = torch.randn(8, 64, device=DEV, generator=gen)
        o, w = g(x), ref(x)
        assert torch.equal(o, w)
        return o, w

    # as the bench's grad-mode step: each output kept until the next call's returns (the
    # pieces' captures and trials run meanwhile), then the last one kept for good
    got = None
    for _ in range(6):
        got = step()
    st = g.a.__dict__["_cudagraphify_state"]
    for _ in range(6):  # (the calls that find its graph waiting: timed as eager samples)
        step()
    replays = st.replays
    for _ in range(4):
        step()
    assert st.given_back is None, st.given_back
    assert len(list(st.cache.graphs(st))) == 2, dict(st.eager_calls)
    assert st.replays - replays == 4, (st.replays - replays, dict(st.eager_calls))
    # a backward through the output kept: gradients as eager's
    o, w = got
    o.sum().backward(), w.sum().backward()
    for p, q in zip(ref.parameters(), g.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL)
