"""F1 of tests/test_review_hunt4.py on a GPU: two parameters whose gradients autograd computes
as one tensor (``W + delta`` fed to ``F.linear``; ``x + (pos + seg)``) get their ``.grad`` on
ONE memory after a replay with ``zero_grad()``'s default (set_to_none=True): the backward graph
returns one static buffer for both and each parameter adopts it. Eager never shares. Values are
right, so a plain step is; every in-place write to ``.grad`` before the step applies twice.
Checks (Linear-sized 64x64, 6 steps, eager twin from copy.deepcopy, bitwise):
  [control] eager twin: weight.grad and delta.grad on two memories;
  [finding] W + delta: weight.grad and delta.grad on one memory after a replay (eager: two);
  [finding] W + delta, SGD(momentum) + clip_grad_norm_: parameters/grads differ from eager's;
  [finding] pos + seg, GradScaler (scale, unscale_, step, update) + Adam: differ;
  [finding] W + delta, p.grad /= 4 by hand: differ;
  [control] W + delta, SGD(momentum) without in-place writes to .grad: equal;
  [control] W + delta, clip_grad_norm_ with zero_grad(set_to_none=False): equal.
Run from the repository root: python3 .ci/review/hunt4/a_shared_grads.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_shared_grads.py")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 64
STEPS = 6


class Delta(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(W, W) / 8)
        self.delta = nn.Parameter(torch.zeros(W, W))

    def forward(self, x):
        return F.linear(x, self.weight + self.delta)


class PosSeg(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8, W))
        self.seg = nn.Parameter(torch.randn(8, W))
        self.out = nn.Linear(W, W)

    def forward(self, x):
        return self.out(x + (self.pos + self.seg))


def opt_of(m, st, kind="sgdm"):
    if "opt" not in st:
        st["opt"] = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if kind == "sgdm"
                     else torch.optim.Adam(m.parameters(), lr=0.01))
    return st["opt"]


def clip_step(set_to_none=True):
    def step(m, x, st, i):
        opt = opt_of(m, st)
        opt.zero_grad(set_to_none=set_to_none)
        loss = m(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        opt.step()
        return {"loss": loss.detach()}
    return step


def plain_step(m, x, st, i):
    opt = opt_of(m, st)
    opt.zero_grad()
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    return {"loss": loss.detach()}


def scaler_step(m, x, st, i):
    opt = opt_of(m, st, "adam")
    sc = st.setdefault("scaler", torch.amp.GradScaler(C.DEV, init_scale=1024.0))
    opt.zero_grad()
    loss = m(x).square().mean()
    sc.scale(loss).backward()
    sc.unscale_(opt)
    grads = {f"unscaled {n}.grad": p.grad.clone() for n, p in m.named_parameters()}
    sc.step(opt)
    sc.update()
    return {"loss": loss.detach(), **grads}


def average_step(m, x, st, i):
    opt = opt_of(m, st)
    opt.zero_grad()
    loss = m(x).square().mean()
    loss.backward()
    for p in m.parameters():
        p.grad /= 4
    opt.step()
    return {"loss": loss.detach()}


def shared_memory_check():
    import copy
    torch.manual_seed(0)
    ref = Delta().to(C.DEV)
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(4):
        x = torch.randn(8, W, device=C.DEV)
        for m in (g, ref):
            m.zero_grad()
            m(x).square().mean().backward()
    C.sync_all()

    def shared(m):
        return m.weight.grad.untyped_storage().data_ptr() == \
            m.delta.grad.untyped_storage().data_ptr()
    C.info(f"W + delta, 4 steps: {C.stats_line(g)}")
    C.check(not shared(ref), "[control] eager: weight.grad and delta.grad on two memories")
    C.check(not shared(g), "[finding] W + delta: weight.grad and delta.grad on two memories "
            "after a replay, as eager's", "they share one memory (the static gradient buffer)")


def case(tag, what, make, step):
    bad, g = C.train_twins(make, step, STEPS)
    C.check(bad is None, f"[{tag}] {what}: {STEPS} steps equal eager's", str(bad))
    C.info(f"{what}: {C.stats_line(g)}")


shared_memory_check()
case("finding", "W + delta, SGD(momentum) + clip_grad_norm_", Delta, clip_step())
case("finding", "pos + seg, GradScaler + Adam", PosSeg, scaler_step)
case("finding", "W + delta, p.grad /= 4", Delta, average_step)
case("control", "W + delta, SGD(momentum), no write to .grad", Delta, plain_step)
case("control", "W + delta, clip_grad_norm_, zero_grad(set_to_none=False)", Delta,
     clip_step(set_to_none=False))
C.finish("a_shared_grads")
