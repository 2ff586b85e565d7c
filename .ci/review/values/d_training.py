"""Training graphs whose parameters' gradients share one memory (42bd2ce: one adopted as
``.grad``, the others copied), against an eager twin (controls of
tests/test_review_values.py; bitwise where the same kernels run).

Checks (six steps each; loss = mean(out^2); clip_grad_norm_(0.01) in place on every .grad,
then p -= 0.1 * p.grad; parameters and .grad compared after each step):
  [control] three parameters with one gradient (``w + d1 + d2``), zero_grad(set_to_none=True),
            zero_grad(set_to_none=False), and two micro-batches accumulated per step;
  [control] a gradient that is a transposed view of another's (``w + v.t()``), same three;
  [control] one parameter's .grad set to None each step, the other accumulating (mode 2 and
            mode 1 on one buffer), in-place scaling of both.
On the GPU values within rtol 1e-4 / atol 1e-6 (a capture may pick other GEMM kernels; a clip
applied twice, the bug 42bd2ce fixed, is off by its coefficient, far beyond that); bitwise on
DEV=cpu.
Run from the repository root: python3 .ci/review/values/d_training.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("d_training.py")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 256


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(W, W) / 16)
        self.d1 = nn.Parameter(torch.zeros(W, W))
        self.d2 = nn.Parameter(torch.zeros(W, W))

    def forward(self, x):
        return F.linear(x, self.w + self.d1 + self.d2)


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(W, W) / 16)
        self.v = nn.Parameter(torch.randn(W, W) / 16)

    def forward(self, x):
        return F.linear(x, self.w + self.v.t())


def clip(none=True, accum=False):
    def step(m, x, i):
        if not accum or i % 2 == 0:
            m.zero_grad(set_to_none=none)
        m(x).square().mean().backward()
        if accum and i % 2 == 0:
            return
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
    return step


def one_none(m, x, i):
    m.d1.grad = None
    m(x).square().mean().backward()
    m.d1.grad.mul_(0.5)
    m.w.grad.mul_(0.5)


def close(got, want):
    if C.CPU:
        return C.same(got, want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, "dtype/shape differ from eager's"
    if torch.allclose(got, want, rtol=1e-4, atol=1e-6):
        return True, ""
    return False, f"values differ from eager's (max abs diff {(got - want).abs().max().item()})"


def case(name, make, step, steps=6):
    torch.manual_seed(0)
    ref = make().to(C.DEV)
    g = cg.graphify(copy.deepcopy(ref))
    ok, why = True, ""
    for i in range(steps):
        x = torch.randn(16, W, device=C.DEV)
        for m in (g, ref):
            step(m, x, i)
        for (n, p), q in zip(g.named_parameters(), ref.parameters()):
            ok, why = True, ""
            if (p.grad is None) != (q.grad is None):
                ok, why = False, ".grad None on one side only"
            elif q.grad is not None:  # (first: a clip applied twice shows most there)
                ok, why = close(p.grad, q.grad)
                why = why and ".grad: " + why
            if ok:
                ok, why = close(p.detach(), q.detach())
            if not ok:
                why = f"step {i}, {n}: {why}"
                break
        if not ok:
            break
    s = cg.stats(g)
    if ok and (s.eager or s.replays < 3):
        ok, why = False, "not replayed"
    C.check(ok, f"[control] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


if __name__ == "__main__":
    for label, make in (("w + d1 + d2", Three), ("w + v.t()", Transposed)):
        case(f"{label}, clip, set_to_none=True", make, clip())
        case(f"{label}, clip, set_to_none=False", make, clip(none=False))
        case(f"{label}, clip, two micro-batches", make, clip(accum=True))
    case("w + d1 + d2, d1.grad None each step, w accumulating", Three, one_none)
    C.finish("d_training.py")
