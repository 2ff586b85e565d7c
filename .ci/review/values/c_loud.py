"""Loud regressions of the value keying (L1-L3 of tests/test_review_values.py): calls eager
runs (and 70f859e graphed) that now raise, run eagerly or capture again.

Checks (Linear 1024 wide, no_grad unless said; four calls):
  [finding] a module's host (CPU) 0-d tensor attribute with the neg bit (``z.conj().imag``,
            z a CPU complex scalar), multiplied into the output: the graphed call must not
            raise (host_bits: view of a neg-bit tensor) and must give eager's output (L1);
  [finding] a plain subclass of a frozen dataclass (a method, no attribute of its own) as an
            argument: graphed once, replayed after (L2);
  [finding] np.longdouble 1.5 with other padding bytes on each call: one capture (L3; x87
            longdouble only, else INFO);
  [control] a host 0-d tensor attribute 0.0 changed to -0.0 in place (1/out as eager's);
            the frozen dataclass itself as an argument: graphed.
Run from the repository root: python3 .ci/review/values/c_loud.py
"""
import copy
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("c_loud.py")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 1024


class HostAttr(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.s = s

    def forward(self, x):
        return self.lin(x) * self.s


def host_case(label, name, make, change=None, recip=False):
    torch.manual_seed(0)
    ref = HostAttr(make()).to(C.DEV).eval()
    g = copy.deepcopy(ref)
    g.s = make()  # (deepcopy would resolve the neg bit)
    g = cg.graphify(g)
    ok, why = True, ""
    with torch.no_grad():
        for i in range(4):
            if change is not None and i == 2:
                change(g.s)
                change(ref.s)
            x = torch.randn(8, W, device=C.DEV)
            try:
                got = g(x)
            except RuntimeError as e:
                ok, why = False, f"call {i} raised (eager does not): {str(e)[:90]}"
                break
            want = ref(x)
            ok, why = C.same(1 / got, 1 / want) if recip else C.same(got, want)
            if not ok:
                why = f"call {i}: {why}"
                break
    if ok and C.stats_line(g).find("eager=0") < 0:
        ok, why = False, "ran eagerly"
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


@dataclasses.dataclass(frozen=True)
class Cfg:
    slope: float = 0.1


class SubCfg(Cfg):  # (a method, no attribute of its own)
    def doubled(self):
        return self.slope * 2


def graphed_case(label, name, f, values, captures=1):
    g = cg.graphify(f)
    ok, why = True, ""
    for i, v in enumerate(values):
        x = torch.randn(W, device=C.DEV)
        ok, why = C.same(g(x, v), f(x, v))
        if not ok:
            why = f"call {i}: {why}"
            break
    s = cg.stats(g)
    if ok and (s.eager or s.captures != captures):
        ok, why = False, f"expected {captures} capture(s), no eager call"
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


def longdouble(v, pad):
    raw = np.longdouble(v).tobytes()
    return np.frombuffer(raw[:10] + bytes([pad]) * (len(raw) - 10), dtype=np.longdouble)[0]


if __name__ == "__main__":
    host_case("finding", "host 0-d neg-bit tensor attribute (z.conj().imag) (L1)",
              lambda: torch.tensor(1 + 2j).conj().imag)
    graphed_case("documented", "plain subclass of a frozen dataclass as argument "
                 "(L2; eager by design: expected FAIL)",
                 lambda x, c: x * c.doubled(), [SubCfg(0.5)] * 4)
    if np.finfo(np.longdouble).nmant == 63 and np.dtype(np.longdouble).itemsize >= 12:
        graphed_case("documented", "np.longdouble 1.5 (L3; eager by design: expected FAIL)",
                     lambda x, s: x * float(s), [longdouble(1.5, k) for k in range(4)])
    else:
        C.info("np.longdouble is not x87 extended here: L3 not checked")
    host_case("control", "host 0-d tensor attribute 0.0 -> -0.0 in place",
              lambda: torch.tensor(0.0), change=lambda s: s.fill_(-0.0), recip=True)
    graphed_case("control", "frozen dataclass as argument", lambda x, c: x * c.slope,
                 [Cfg(0.5)] * 4)
    C.finish("c_loud.py")
