"""lk2 findings on CUDA: F1 a region's borrowed slot captured plain for a Parameter-wrapped
alias; F2 a forward binding its Parameter argument registers the graph's static copy (and
captures for nothing); P1 the same with nn.Parameter(x) of a plain argument; P2 an output's
class / attributes lost on replay. CPU: tests/test_review_lk2.py."""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEV, D, N, P, check, finish, rand, skip_without_cuda, stats_line, \
    sync_all, twins  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("a_findings")
import cudagraphify as cg  # noqa: E402


class A(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return x * self.w


class B(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return x * self.w * (2.0 if isinstance(x, nn.Parameter) else 3.0)


# -- F1 -----------------------------------------------------------------------------------------
for wrapped in (False, True):
    torch.manual_seed(0)
    ra, rb = A().to(DEV), B().to(DEV)
    ga, gb = cg.graphify(copy.deepcopy(ra)), cg.graphify(copy.deepcopy(rb))
    res = []
    with torch.no_grad(), cg.graph_region():
        for _ in range(5):
            x = rand()
            h, hr = ga(x), ra(x)
            if wrapped:
                h, hr = P(h), P(hr)
            res.append(torch.equal(gb(h), rb(hr)))
    sync_all()
    tag = "[finding] F1 region alias wrapped as nn.Parameter, isinstance branch" if wrapped \
        else "[control] F1 region alias passed as it is"
    check(all(res) and cg.stats(gb).replays >= 1, tag, f"{res} ({stats_line(gb)})")


# -- F2 / P1 ------------------------------------------------------------------------------------
class Bind(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.make = make

    def forward(self, x):
        self.seen = self.make(x)
        return self.seen * self.w


for label, make, arg in (("F2 self.seen = x (a Parameter argument)", None, P),
                         ("P1 self.seen = nn.Parameter(x) (a plain argument)",
                          lambda x: nn.Parameter(x, requires_grad=False), lambda t: t)):
    torch.manual_seed(0)
    ref = Bind(make or (lambda x: x)).to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    res = []
    with torch.no_grad():
        for _ in range(6):
            t = rand()
            p1, p2 = arg(t.clone()), arg(t.clone())
            ok = torch.equal(g(p1), ref(p2))
            res.append(ok and (g.seen is p1 if make is None
                               else g.seen.data_ptr() == p1.data_ptr()))
    sync_all()
    check(all(res), f"[finding] {label}: the module holds the caller's tensor",
          f"{res} ({stats_line(g)})")
    s = cg.stats(g)
    if make is None:
        check(s.captures == 0 or s.replays >= 1, f"[finding] {label}: no capture for nothing",
              stats_line(g))


# -- P2 -----------------------------------------------------------------------------------------
def tagged(m, x):
    h = x * m.w
    h.tag = 1
    return h


for label, body in (("Parameter of the argument",
                     lambda m, x: (x * m.w, nn.Parameter(x, requires_grad=False))),
                    ("Parameter of an intermediate",
                     lambda m, x: nn.Parameter(x * m.w, requires_grad=False)),
                    ("tagged intermediate", tagged)):
    g, ref = twins(body)
    res = []
    with torch.no_grad():
        for _ in range(5):
            x = rand()
            o1, o2 = g(x), ref(x)
            o1 = o1 if isinstance(o1, tuple) else (o1,)
            o2 = o2 if isinstance(o2, tuple) else (o2,)
            res.append(all(type(a) is type(b) and torch.equal(a, b)
                           and vars(a).keys() == vars(b).keys() for a, b in zip(o1, o2)))
    sync_all()
    # (since the fix: such an output runs eagerly, with the reason)
    check(all(res) and any("a replay would hand out a plain tensor" in k
                           for k in cg.stats(g).eager_calls),
          f"[finding] P2 output {label}: class and attributes as eager's (eager, refused)",
          f"{res} ({stats_line(g)})")

finish("a_findings")
