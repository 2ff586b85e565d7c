"""F1 (fixed on ``percall``: an argument the forward writes that shares memory with a parameter or
buffer it reads runs eagerly), in variants the fix's own tests do not cover; against eager, the
module's parameters/buffers compared after every call. All [control]:
  the argument a view of a flat parameter at an offset (outside the part the forward reads);
  a parameter view first (read in place: pinned), plain tensors, then the view again;
  the buffer itself passed, under grad mode (a training graph), gradients compared;
  the buffer itself passed, inside a graph_region;
  a view of a buffer the forward writes too.
Run from the repository root: python3 .ci/review/percall2/e_written.py
"""
import contextlib
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("e_written.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402


class ReadsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("state", torch.randn(64))

    def forward(self, x):
        x.mul_(2)
        return self.lin(self.state)


class ReadsFlat(nn.Module):
    def __init__(self):
        super().__init__()
        self.flat = nn.Parameter(torch.randn(192), requires_grad=False)

    def forward(self, x):
        x.add_(1)
        return self.flat[:128].view(2, 64) @ torch.ones(64, device=x.device)


class WritesBoth(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.ones(64))

    def forward(self, x):
        x.mul_(2)
        self.state.add_(1)
        return self.state[:32] * 3 + x


def case(name, cls, alias, n=64, grad=False, region=False, plain_later=False):
    def body():
        torch.manual_seed(0)
        ref = cls().to(C.DEV)
        if not grad:
            ref.eval()
        g = cg.graphify(copy.deepcopy(ref))
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx, (cg.graph_region() if region else contextlib.nullcontext()):
            for i in range(8):
                use_alias = (i < 3 or i >= 6) if plain_later else i >= 3
                if not use_alias:
                    xa = torch.randn(n, device=C.DEV)
                    a, b = g(xa.clone()), ref(xa.clone())
                else:
                    a, b = g(alias(g)), ref(alias(ref))
                C.sync_all()
                ok, why = C.same(a, b)
                for p, q in zip(g.state_dict().values(), ref.state_dict().values()):
                    if ok:
                        ok, why = C.same(p, q)
                if ok and grad:
                    a.sum().backward()
                    b.sum().backward()
                    ok, why = C.same(g.lin.weight.grad, ref.lin.weight.grad)
                if not ok:
                    return False, f"call {i}: {why} {C.stats_line(g)}"
        C.info(f"{name}: {C.stats_line(g)}")
        return True, ""
    C.guarded("control", name, body)


if __name__ == "__main__":
    case("written argument = flat parameter view at an offset", ReadsFlat,
         lambda m: m.flat[128:192])
    case("parameter view, plain tensors, the view again", ReadsFlat, lambda m: m.flat[64:128],
         plain_later=True)
    case("buffer passed, grad mode", ReadsBuffer, lambda m: m.state, grad=True)
    case("buffer passed, in a graph_region", ReadsBuffer, lambda m: m.state, region=True)
    case("view of a buffer the forward writes too", WritesBoth, lambda m: m.state[16:48], n=32)
    C.finish("e_written.py")
