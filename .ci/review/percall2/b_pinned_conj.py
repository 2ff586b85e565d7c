"""A parameter passed as an argument (read in place: pinned at the first call) whose conj or
neg bit changes (finding S5 of tests/test_review_percall2.py), against eager. F4 keys the bits
of arguments static in the key (static_argnames, mark_static) only; a pinned parameter is keyed
as a copied tensor (no address, no conj bit) and its graph reads the raw memory.
  [finding] m(x, m.w) x3 -> m(x, m.w.conj());
  [finding] m(x, m.w) x3 -> m(x, torch._neg_view(m.w));
  [control] static_argnames, buf -> buf.conj() (F4, fixed).
Run from the repository root: python3 .ci/review/percall2/b_pinned_conj.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("b_pinned_conj.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

N = 4096


class ParamArg(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(N, dtype=torch.complex64), requires_grad=False)

    def forward(self, x, v):
        return x * 2 + v


def pinned(label, name, later):
    def body():
        torch.manual_seed(0)
        ref = ParamArg().to(C.DEV).eval()
        g = cg.graphify(copy.deepcopy(ref))
        with torch.no_grad():
            for i in range(6):
                x = torch.randn(N, dtype=torch.complex64, device=C.DEV)
                mk = (lambda m: m.w) if i < 3 else later
                got, want = g(x, mk(g)), ref(x, mk(ref))
                C.sync_all()
                ok, why = C.same(got, want)
                if not ok:
                    return False, f"call {i}: {why} {C.stats_line(g)}"
        C.info(f"{name}: {C.stats_line(g)}")
        return True, ""
    C.guarded(label, name, body)


def plus(x, buf):
    return x * 2 + buf


def static_control():
    g = cg.graphify(plus, static_argnames=("buf",))
    buf = torch.randn(N, dtype=torch.complex64, device=C.DEV)
    for i in range(6):
        x = torch.randn(N, dtype=torch.complex64, device=C.DEV)
        b = buf if i < 3 else buf.conj()
        ok, why = C.same(g(x, b), plus(x, b))
        if not ok:
            return False, f"call {i}: {why}"
    return True, ""


if __name__ == "__main__":
    pinned("finding", "S5 pinned parameter argument w -> w.conj()", lambda m: m.w.conj())
    pinned("finding", "S5 pinned parameter argument w -> _neg_view(w)",
           lambda m: torch._neg_view(m.w))
    C.guarded("control", "static_argnames buf -> buf.conj() (F4)", static_control)
    C.finish("b_pinned_conj.py")
