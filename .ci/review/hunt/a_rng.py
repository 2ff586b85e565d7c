"""Random state after graphed calls, against an eager twin seeded alike.

A CUDA capture draws no random numbers (the generator's offset does not move; a replay moves it
by what the graph draws), so a graphed call should leave the device generator where eager's
call leaves it, and later replays should draw eager's masks. The rehearsal puts the RNG state
back (cudagraphify/_rehearsal.py); the extra warm-ups (cudagraphify/_warmups.py: always one in
training, ``num_warmup_iters - 1`` in inference) and the segments' check runs
(cudagraphify/_segrun.py: a warm-up and a checking replay) do not.
Checks (Linear -> Dropout(0.5) in train mode, seeded once, inputs from a CPU generator):
  [control] inference, default options: outputs and RNG state as eager's after every call;
  [control] inference, torch.manual_seed before every call: outputs as eager's;
  [finding] inference, num_warmup_iters=3: outputs/RNG as eager's after every call;
  [finding] training (grad mode, a backward after each call), default options: the same;
  [finding] segments=True, a forward with .item() between Linear and dropout: the same.
Run from the repository root: python3 .ci/review/hunt/a_rng.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_rng.py")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 256


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


class DropItem(nn.Module):
    """A host sync in the middle: the forward runs eagerly, its pieces or segments graphed."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x):
        y = self.lin(x)
        k = 1.0 if y.abs().sum().item() >= 0 else 2.0
        return F.dropout(y * k, 0.5, training=True) + 1


def sequence(model, grad: bool, calls: int = 5, reseed: bool = False):
    gen = torch.Generator().manual_seed(3)  # inputs: the CPU generator of their own
    xs = [torch.randn(8, W, generator=gen).to(C.DEV) for _ in range(calls)]
    torch.manual_seed(7)
    out = []
    for i, x in enumerate(xs):
        if reseed:
            torch.manual_seed(100 + i)
        with torch.set_grad_enabled(grad):
            y = model(x)
            if grad:
                y.sum().backward()
        out.append((y.detach().clone(), C.rng_state().clone()))
    C.sync_all()
    return out


def compare(make, grad=False, reseed=False, **options) -> str:
    torch.manual_seed(0)
    ref = make().to(C.DEV)
    g = cg.graphify(copy.deepcopy(ref), **options)
    want = sequence(ref, grad, reseed=reseed)
    got = sequence(g, grad, reseed=reseed)
    for i, ((a, ra), (b, rb)) in enumerate(zip(want, got)):
        if not torch.equal(a, b):
            return f"call {i}: output differs from eager's ({C.stats_line(g)})"
        if not reseed and not torch.equal(ra, rb):
            return f"call {i}: the RNG state after it differs from eager's ({C.stats_line(g)})"
    s = cg.stats(g)
    if s.replays + s.segment_replays == 0 and not s.pieces:
        return f"nothing replayed: {C.stats_line(g)}"
    C.info(f"{make.__name__} grad={grad} {options}: {C.stats_line(g)}")
    cg.ungraphify(g)
    return ""


why = compare(Drop)
C.check(not why, "[control] inference dropout, default options: outputs and RNG as eager's", why)
why = compare(Drop, reseed=True)
C.check(not why, "[control] inference dropout, manual_seed before each call: outputs as eager's",
        why)
why = compare(Drop, num_warmup_iters=3)
C.check(not why, "[finding] inference dropout, num_warmup_iters=3: outputs and RNG as eager's",
        why)
why = compare(Drop, grad=True)
C.check(not why, "[finding] training dropout, default options: outputs and RNG as eager's", why)
why = compare(DropItem, segments=True)
C.check(not why, "[finding] segments=True, .item() then dropout: outputs and RNG as eager's", why)
C.finish("a_rng.py")
