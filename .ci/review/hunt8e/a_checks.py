"""Hunt-8e review on CUDA: a tensor passed twice gets one static copy (5dcf40f): where the
capture still does not see ``x is y`` (S1 chained outputs, S2 a static name, S3 bucketing),
a needless eager self-attention piece (L1), the shared buffer copied twice (C1), and controls
beside them. CPU reproductions: tests/test_review_hunt8e.py."""
import copy
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, DEV, D, N, Body, Lin, check, finish, info, rand, replays, same, \
    skip_without_cuda, stats_line, sync_all, twin, untimed  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("a_checks")
import cudagraphify as cg  # noqa: E402

untimed()
warnings.simplefilter("ignore")
T0 = time.perf_counter()


def line(kind, label, res, g, extra_ok=True, need=3):
    """One check: every call eager's bitwise, at least ``need`` replays of ``g``."""
    ok = all(o for o, _ in res) and sum(r for _, r in res) >= need and extra_ok
    check(ok, f"[{kind}] {label}", f"{res} ({stats_line(g)})")


def eq(a, b):
    sync_all()
    return same(a.detach(), b.detach())[0]


# -- S1: a chained output passed twice: captured as (slot, copy) -------------------------------
for how in ("region_per_call", "one_region"):
    torch.manual_seed(0)
    r1, r2 = Lin().to(DEV), Body().to(DEV)
    g1, g2 = cg.graphify(copy.deepcopy(r1)), cg.graphify(copy.deepcopy(r2))
    res = []
    with torch.no_grad():
        outer = cg.graph_region()
        if how == "one_region":
            outer.__enter__()
        for i in range(5):
            x = rand()
            if how == "region_per_call":
                with cg.graph_region():
                    h = g1(x)
                    r0 = replays(g2)
                    got = g2(h, h).clone()
            else:
                h = g1(x)
                r0 = replays(g2)
                got = g2(h, h).clone()
            hr = r1(x)
            res.append((eq(got, r2(hr, hr)), replays(g2) - r0))
        if how == "one_region":
            outer.__exit__(None, None, None)
    line("finding", f"S1 graph_region ({how}): g2(h, h), h an earlier graph's output, x is y "
         "branch", res, g2)


class Root(nn.Module):
    """A root refused (``.item()``): a piecewise plan, ``a`` and ``b`` its pieces, chained."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Lin(), Body()

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > 1e9:
            h = h + 1
        return self.b(h, h)


g, ref = twin(Root)
res = []
with torch.no_grad():
    for i in range(6):
        x = rand()
        r0 = replays(g.b)
        res.append((eq(g(x), ref(x)), replays(g.b) - r0))
line("finding", "S1 piecewise: piece b(h, h) after piece a (x is y branch)", res, g.b)


# -- S2: one object at a static name and a copied position -------------------------------------
class KV(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, kv):
        return x * self.w * (2.0 if x is kv else 3.0) + kv


g, ref = twin(KV, static_argnames="kv")
x = rand()
res = []
with torch.no_grad():
    for i in range(5):
        x.copy_(rand())
        r0 = replays(g)
        res.append((eq(g(x, kv=x), ref(x, kv=x)), replays(g) - r0))
line("finding", "S2 static_argnames='kv', g(x, kv=x): x copied, kv in place", res, g)


# -- S3: bucketed pads a repeated tensor apart ------------------------------------------------
def bucketed_calls(pattern):
    g, ref = twin(Body)
    b = cg.bucketed(g, [N * 2])
    res = []
    with torch.no_grad():
        for i, p in enumerate(pattern):
            torch.manual_seed(10 + i)
            a, c = rand(), rand()
            args = (a, a) if p == "same" else (a, c)
            r0 = replays(g)
            res.append((eq(b(*args), ref(*args)), replays(g) - r0))
    return g, b, res


g, b, res = bucketed_calls(["distinct"] * 3 + ["same"] * 3)
line("finding", "S3 bucketed: b(a, c) x3 then b(t, t) x3 (x is y branch)", res, g,
     extra_ok=not b.refused)
g, b, res = bucketed_calls(["distinct"] * 5)
line("control", "bucketed: distinct calls only", res, g, extra_ok=not b.refused)


# -- L1: self-attention after a graphed piece ---------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        h = self.ln(x)
        if h.sum().item() > 1e9:
            h = h + 1
        return self.mha(h, h, h, need_weights=False)[0] + x


for how in ("piecewise", "region", "alone"):
    torch.manual_seed(0)
    diffs = []
    with torch.no_grad():
        if how == "piecewise":
            ref = Block().to(DEV).eval()
            g = cg.graphify(copy.deepcopy(ref))
            for _ in range(6):
                x = rand(2, 5, 16)
                diffs.append(eq(g(x), ref(x)))
            gm = g.mha
        else:
            ln = nn.LayerNorm(16).to(DEV)
            mha = nn.MultiheadAttention(16, 2, batch_first=True).to(DEV).eval()
            gl, gm = cg.graphify(copy.deepcopy(ln)), cg.graphify(copy.deepcopy(mha))
            region = cg.graph_region() if how == "region" else None
            if region is not None:
                region.__enter__()
            for _ in range(6):
                x = rand(2, 5, 16)
                h = gl(x)
                got = gm(h, h, h, need_weights=False)[0].clone()
                hr = ln(x)
                diffs.append(eq(got, mha(hr, hr, hr, need_weights=False)[0]))
            if region is not None:
                region.__exit__(None, None, None)
    s = cg.stats(gm)
    kind = "control" if how == "alone" else "finding"
    check(s.replays >= 3 and not s.eager_calls,
          f"[{kind}] L1 MHA self-attention mha(h, h, h) {how}: graphed, no eager run",
          stats_line(gm))
    info(f"L1 {how}: bitwise equal to eager per call: {diffs}")


# -- C1: the shared buffer copied in once per leaf ----------------------------------------------
g, ref = twin(Body)
res = []
with torch.no_grad():
    for i in range(5):
        t = rand()
        r0 = replays(g)
        res.append((eq(g(t, t), ref(t, t)), replays(g) - r0))
s = cg.stats(g)
line("control", "f(t, t) positional: x is y branch, one shared copy", res, g)
check(s.input_copies == s.replays, "[finding] C1 f(t, t): one input copy per replay",
      f"{s.input_copies} input copies for {s.replays} replays")


# -- controls -------------------------------------------------------------------------------
class Ret(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        return x, y, x[0], y[1], x * self.w * (2.0 if x is y else 3.0)


for co in (True, False):
    g, ref = twin(Ret, copy_outputs=co)
    res, objs = [], True
    with torch.no_grad():
        for i in range(5):
            t = rand()
            r0 = replays(g)
            got, want = g(t, t), ref(t, t)
            res.append((all(eq(p, q) for p, q in zip(got, want)), replays(g) - r0))
            objs &= got[0] is t and got[1] is t and got[2]._base is t and got[3]._base is t
    line("control", f"f(t, t) returns x, y, x[0], y[1] (copy_outputs={co})", res, g,
         extra_ok=objs)

for x_grad in (False, True):
    g, ref = twin(Body)
    res = []
    for i in range(5):
        torch.manual_seed(i)
        t = rand().requires_grad_(x_grad)
        t2 = t.detach().clone().requires_grad_(x_grad)
        r0 = replays(g)
        a, b = g(t, t), ref(t2, t2)
        a.sum().backward()
        b.sum().backward()
        ok = eq(a, b) and eq(g.w.grad, ref.w.grad) and (not x_grad or eq(t.grad, t2.grad))
        res.append((ok, replays(g) - r0))
    if x_grad:
        refused = any("passed twice" in k for k in cg.stats(g).eager_calls)
        line("control", "training f(t, t), t requires grad: refused, eager right", res, g,
             extra_ok=refused, need=0)
    else:
        line("control", "training f(t, t), t without grad: replays, bitwise grads", res, g)


class Lst(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, xs, y=None):
        return xs[0] * self.w * (2.0 if xs[0] is xs[1] else 3.0) \
            + (5.0 if y is xs[0] else 7.0)


g, ref = twin(Lst)
res = []
with torch.no_grad():
    for i in range(8):
        t, u = rand(), rand()
        xs = [t, t] if i % 2 else [t, u]
        r0 = replays(g)
        res.append((eq(g(xs, y=t), ref(xs, y=t)), replays(g) - r0))
line("control", "g([t, t] / [t, u], y=t) alternating", res, g, need=6)

g, ref = twin(Body, num_warmup_iters=3)
res = []
with torch.no_grad():
    for i in range(5):
        t = rand()
        r0 = replays(g)
        res.append((eq(g(t, t), ref(t, t)), replays(g) - r0))
line("control", "f(t, t) with num_warmup_iters=3", res, g, need=4)


class P3(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.p = nn.Parameter(torch.randn(N, D))

    def forward(self, x, y, z):
        return z * self.w * (2.0 if x is y else 3.0) + y


for how in ("parameter", "static_argnames_both", "mark_static"):
    res = []
    with torch.no_grad():
        if how == "parameter":
            g, ref = twin(P3)
            for i in range(5):
                z = rand()
                r0 = replays(g)
                res.append((eq(g(g.p, g.p, z), ref(ref.p, ref.p, z)), replays(g) - r0))
        else:
            g, ref = twin(KV, **({"static_argnames": ("x", "kv")}
                                 if how == "static_argnames_both" else {}))
            x = rand()
            if how == "mark_static":
                cg.mark_static(x)
            for i in range(5):
                x.copy_(rand())
                r0 = replays(g)
                res.append((eq(g(x=x, kv=x), ref(x=x, kv=x)), replays(g) - r0))
    line("control", f"repeated tensor read in place ({how})", res, g, need=4)

g, ref = twin(Body)
res = []
with torch.no_grad():
    for i in range(8):
        t = rand()
        y = t if i % 2 == 0 else t.clone()
        r0 = replays(g)
        res.append((eq(g(t, y), ref(t, y)), replays(g) - r0))
line("control", "f(t, t) / f(t, t.clone()) alternating: two graphs", res, g, need=6,
     extra_ok=cg.stats(g).captures == 2)


class Writes(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        x.add_(1.0)
        return y * self.w


g, ref = twin(Writes)
res = []
with torch.no_grad():
    for i in range(4):
        t = rand()
        t2 = t.clone()
        res.append((eq(g(t, t), ref(t2, t2)) and eq(t, t2), 0))
line("control", "x.add_(1) in f(x, x): eager, written once", res, g, need=0,
     extra_ok=any("share memory" in k for k in cg.stats(g).eager_calls))

torch.manual_seed(0)
r1, r2 = Lin().to(DEV), Body().to(DEV)
g1, g2 = cg.graphify(copy.deepcopy(r1)), cg.graphify(copy.deepcopy(r2))
res = []
with torch.no_grad(), cg.graph_region():
    for i in range(5):
        x, o = rand(), rand()
        h = g1(x)
        r0 = replays(g2)
        got = g2(h, o).clone()
        res.append((eq(got, r2(r1(x), o)), replays(g2) - r0))
line("control", "graph_region: g2(h, other), h an earlier graph's output", res, g2, need=4)

g, ref = twin(Body)
res = []
with torch.no_grad():
    def both(n):
        t = rand(n, D)
        return (t, t)
    cg.capture_sizes(g, both, [N, N // 2], progress=False)
    for n in (N // 2, N, N // 2):
        t = rand(n, D)
        r0 = replays(g)
        res.append((eq(g(t, t), ref(t, t)), replays(g) - r0))
line("control", "capture_sizes with (t, t) inputs", res, g)

info(f"a_checks took {time.perf_counter() - T0:.1f} s on {DEV}")
finish("a_checks")
