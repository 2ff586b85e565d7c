"""3abfc0c: aliases of graph memory made with .data (a version counter of their own).
D1-D3 are expected to FAIL until fixed (eager raises, the graphed call's backward runs on
written values); the rest are controls. P1 is older than these commits."""
import contextlib
import copy

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import cudagraphify as cg
from common import DEV, backward_outcome, check, counters, guarded, randn


class TwoViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        y = self.lin(x)
        return y, y[0]


def saved_then_written(m, region):
    w = torch.randn(64, device=DEV, requires_grad=True)
    ctx = cg.graph_region() if region else contextlib.nullcontext()
    with ctx:
        with torch.no_grad():
            for _ in range(3):
                m(randn(8, 64))
            x = randn(8, 64)
            y, y0 = m(x)
        loss = (w * y0).sum()
        v = y0._version
        with torch.no_grad():
            y.add_(1)
        return x, y0._version - v, backward_outcome(loss)


def d1_d2(how):
    torch.manual_seed(0)
    ref = TwoViews().to(DEV)
    g = cg.graphify(copy.deepcopy(ref), copy_outputs=(how != "nocopy"))
    _, bump_e, did_e = saved_then_written(ref, region=False)
    x, bump, did = saved_then_written(g, region=(how == "region"))
    with torch.no_grad():
        vals = all(torch.equal(a, b) for a, b in zip(g(x), ref(x)))
    tag = {"nocopy": "D1 copy_outputs=False", "region": "D2 graph_region",
           "copy": "control copy_outputs=True"}[how]
    check(vals and (bump, did) == (bump_e, did_e) == (1, "raised"),
          f"{tag}: y0=y[0] shares y's version counter, backward raises as eager's",
          f"graphed bump={bump} backward {did}; eager bump={bump_e} {did_e}; values equal={vals}; "
          + counters(g))


class Accumulates(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("acc", torch.zeros(64))

    def forward(self, x):
        h = self.lin(x).relu()
        v = self.acc.view(-1)
        h = h * 2
        if x.sum().item() > 1e6:
            v.add_(1)
        return h * 3 + 1


def d3():
    xs = [randn(8, 64) for _ in range(4)]

    def run(m):
        w = torch.randn(64, device=DEV, requires_grad=True)
        outs = []
        with torch.no_grad():
            for x in xs:
                outs.append((x, m(x)))
        v = m.acc._version
        loss = (w * m.acc).sum()
        with torch.no_grad():
            outs.append((None, m(torch.full((8, 64), 1e5, device=DEV))))
        return m.acc._version - v, backward_outcome(loss), outs

    torch.manual_seed(0)
    ref = Accumulates().to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref), segments=True)
    bump, did, outs = run(g)
    bump_e, did_e, outs_e = run(ref)
    vals = all(torch.equal(a[1], b[1]) for a, b in zip(outs, outs_e)) and \
        torch.equal(g.acc, ref.acc)
    check(vals and (bump, did) == (bump_e, did_e) == (1, "raised"),
          "D3 segments: a write through a handed view of a buffer bumps the buffer's version",
          f"graphed bump={bump} {did}; eager bump={bump_e} {did_e}; values equal={vals}; "
          + counters(g))


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x).relu() + 1


class Sub(torch.Tensor):
    pass


class Wrapping(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out.as_subclass(Sub) if type(out) is torch.Tensor else out


def controls(how):
    torch.manual_seed(0)
    ref = Lin().to(DEV)
    g = cg.graphify(copy.deepcopy(ref), copy_outputs=(how != "nocopy"))
    ctx = cg.graph_region() if how == "region" else torch.no_grad()
    ok = True
    with torch.no_grad(), ctx:
        for _ in range(3):
            x = randn(8, 64)
            ok &= torch.equal(g(x), ref(x))
        y1 = g(randn(8, 64)).clone()
        y2 = g(randn(8, 64))
        y1.add_(1)
        ok &= y2._version == 0
        r = cg.stats(g).replays
        x = randn(8, 64)
        with Wrapping():
            got, want = g(x), ref(x)
        ok &= type(got) is type(want) is Sub and torch.equal(got, want)
        ok &= cg.stats(g).replays == r + 1
    check(ok, f"control {how}: eager-equal, own counters, a TorchFunctionMode around the call",
          counters(g))
    with torch.inference_mode():
        ctx = cg.graph_region() if how == "region" else torch.no_grad()
        with ctx:
            ok = True
            for _ in range(4):
                got = None
                x = randn(8, 64)
                got, want = g(x), ref(x)
                ok &= torch.equal(got, want)
            ok &= got.is_inference() == want.is_inference()
    check(ok, f"control {how} under inference_mode: eager-equal inference tensors", counters(g))


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        h1 = self.a(x)
        h2 = self.a(h1)
        if bool((h2 > -1e9).all()):
            h2 = h2 + 1
        return self.b(h2) + h1


def p1(mode):
    torch.manual_seed(0)
    ref = Twice().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    ok = True
    with getattr(torch, mode)():
        for _ in range(6):
            x = randn(8, 64)
            ok &= torch.equal(g(x), ref(x))
    s = cg.stats(g.a)
    check(ok and s.replays == 10 and not s.eager_calls,
          f"P1 ({mode}): a held chained output is moved, the piece replays", counters(g.a))


for how in ("copy", "nocopy", "region"):
    guarded(f"D1/D2 {how}", lambda how=how: d1_d2(how))
guarded("D3", d3)
for how in ("nocopy", "region"):
    guarded(f"control {how}", lambda how=how: controls(how))
for mode in ("no_grad", "inference_mode"):
    guarded(f"P1 {mode}", lambda mode=mode: p1(mode))
