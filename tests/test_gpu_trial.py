"""GPU: a piecewise plan's pieces timed against their eager runs (cudagraphify/_trial.py), with
the real clock: a piece of one elementwise kernel costs more graphed (copy-in, replay, clone)
than eager and is given back; a piece of forty kernels keeps its graph. Every output equals
eager's bitwise, through the trial and after it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine

pytestmark = [pytest.mark.cuda, pytest.mark.times_pieces, pytest.mark.usefixtures("quiet_gpu")]


class _Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(20) for m in (nn.Linear(16, 16),
                                                                      nn.ReLU())])

    def forward(self, x):
        return self.layers(x)


class _Model(nn.Module):
    """A host sync between a one-kernel piece and a forty-kernel one."""

    def __init__(self):
        super().__init__()
        self.small = nn.ReLU()
        self.deep = _Deep()

    def forward(self, x):
        y = self.small(x)
        if y.sum().item() > 1e9:  # a host sync: piecewise
            y = y * 0
        return self.deep(y)


def test_a_piece_that_does_not_pay_is_given_back_and_one_that_does_keeps_its_graph():
    torch.manual_seed(0)
    ref = _Model().cuda()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(12):
            x = torch.randn(4, 16, device="cuda")
            assert torch.equal(g(x), ref(x))
    small, deep = cg.stats(g.small), cg.stats(g.deep)
    assert small.timed_calls == 3 and small.graphs == 0, small
    (why,) = small.eager_calls
    assert why.startswith("piece given back: its graph "), why  # (costs more, or no less)
    # (its plain forward back in place: its later calls cost what they cost without us)
    assert "forward" not in g.small.__dict__ and small.eager_calls[why] == 0
    assert deep.timed_calls == 3 and deep.graphs == 1, deep
    # the root's plan trial (see _trial): calls 2-7 timed again (the pieces' own trials ran
    # in them), call 8 its first forward with the pieces, 9 and 10 without them (plain)
    assert deep.eager_calls == {_engine.PLAN_PLAIN: 2}, deep
    # (call 1: the root's; 3 timed eager; its capture call replays too, chained)
    assert deep.replays == 12 - 1 - 3 - 2
    assert g.deep._cudagraphify_state._fast is not None


def test_training_pieces_are_timed_too_and_train_as_eager_does():
    """Grad-mode forwards with their backward: each piece's training graph is timed (its
    forward) before it is kept or given back; outputs bitwise and gradients within a tight
    tolerance of eager's (a graphed backward reads its grad_output from a contiguous static
    copy: cuBLAS may take another kernel) on every step, through the trials and after."""
    torch.manual_seed(0)
    ref = _Model().cuda()
    g = cg.graphify(copy.deepcopy(ref))
    for step in range(16):
        x = torch.randn(4, 16, device="cuda")
        out, want = g(x), ref(x)
        assert torch.equal(out, want), step
        out.square().sum().backward(), want.square().sum().backward()
        for (name, p), q in zip(g.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
        g.zero_grad(), ref.zero_grad()
    small, deep = cg.stats(g.small), cg.stats(g.deep)
    assert small.graphs == 0 and small.timed_calls >= 3, small  # (ReLU: no graph pays)
    assert deep.timed_calls >= 3, deep  # (kept or given back: the machine's speed decides)
