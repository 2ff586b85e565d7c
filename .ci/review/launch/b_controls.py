"""launch review controls on CUDA: edge cases around the launch point that should PASS (each
output bitwise equal to eager, the replay and divergence counts as expected)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (D, DEV, Attr, check, compare, describe, graphed, plan_of,  # noqa: E402
                    setup, xy)

setup("b_controls")
import torch  # noqa: E402
from torch import nn  # noqa: E402

# C1: F1's model without the tensor attribute: one replay per replayed call
torch.manual_seed(0)
m = Attr(None.__class__).to(DEV).eval()
g = graphed(m)
ok, why = compare(m, g, xy(6))
p = plan_of(g)
good = p is not None and p.replays == 4 and p.divergences == 0 and p.whole > 0
check(ok and good, f"[control] C1 F1's model, no tensor attribute: as eager, 4 replays in 4 "
      f"replayed calls [{describe(g)}]", why or "counts")

FLAGS = {"alpha": False, "ret": False, "raise": None, "side": False}
SIDE = [torch.cuda.Stream()] if DEV != "cpu" else []  # (a global: a module's would be deep-copied)


class Probe(nn.Module):
    """One segment: x copied at its first call, y at ``+ y`` (the launch); ``FLAGS`` (a global:
    no guard reads it) steer what the forward does around the launch."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        a = x * 2
        b = a.tanh()
        c = b * self.w
        if FLAGS["raise"] == "before":
            raise ValueError("before the launch")
        d = torch.add(c, y, alpha=2.0) if FLAGS["alpha"] else c + y  # launch
        if FLAGS["raise"] == "after":
            raise ValueError("after the launch")
        if FLAGS["ret"]:
            return d * 1.5
        if FLAGS["side"] and SIDE:  # (the user's own, correct, stream sync)
            SIDE[0].wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(SIDE[0]):
                e = d.sigmoid() + 1.0
            torch.cuda.current_stream().wait_stream(SIDE[0])
        else:
            e = d.sigmoid() + 1.0
        f = e * self.w
        return f * f.abs().amax().item()


def probe():
    torch.manual_seed(0)
    m = Probe().to(DEV).eval()
    g = graphed(m)
    inputs = xy(5)
    ok, why = compare(m, g, inputs)
    return m, g, inputs, ok, why


m, g, inputs, ok, why = probe()
p = plan_of(g)
seg = p.segments[0] if p is not None else None
good = seg is not None and seg.graph is not None and \
    seg.first < getattr(seg, "launch", seg.first + 1) < seg.last
check(ok and good, f"[control] C2 inputs new on every call, y copied mid-segment "
      f"[{describe(g)}]", why or "launch not mid-segment")

r0, d0 = p.replays, p.divergences
FLAGS["alpha"] = True
ok, why = compare(m, g, inputs[:2])
FLAGS["alpha"] = False
good = p.divergences == d0 + 2 and p.replays == r0 + 2
ok2, why2 = compare(m, g, inputs)
check(ok and good and ok2, "[control] C3 divergence at the launch call itself, then matching "
      f"calls again [{describe(g)}]", why or why2 or "counts")

FLAGS["ret"] = True
ok, why = compare(m, g, inputs[:2])
FLAGS["ret"] = False
ok2, why2 = compare(m, g, inputs)
check(ok and ok2, f"[control] C4 the forward returns after the launch [{describe(g)}]",
      why or why2)

raised = 0
for where in ("before", "after"):
    FLAGS["raise"] = where
    with torch.no_grad():
        for x, y in inputs[:2]:
            try:
                g(x, y)
            except ValueError:
                raised += 1
    FLAGS["raise"] = None
ok, why = compare(m, g, inputs)
check(ok and raised == 4, "[control] C5 the forward raises before / after the launch, then "
      f"runs again [{describe(g)}]", why or f"raised {raised} of 4")

if DEV != "cpu":
    FLAGS["side"] = True
    m, g, inputs, ok, why = probe()
    ok2, why2 = compare(m, g, inputs)
    FLAGS["side"] = False
    check(ok and ok2, "[control] C6 after the launch, the forward moves to a side stream with "
          f"wait_stream (as eager needs) [{describe(g)}]", why or why2)


class TwoSegs(nn.Module):
    """Two segments around an ``.item()``: the second reads the first's outputs in place and
    copies nothing (it launches at its first call)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, y):
        a = self.fc(x).relu()
        b = a + y
        c = b.tanh()
        n = c.abs().amax().item()
        d = self.fc(b) * (1.0 if n < 1e30 else 0.5)  # (n steers Python only)
        e = d + a
        return e * e.sum().item()


torch.manual_seed(0)
m = TwoSegs().to(DEV).eval()
g = graphed(m)
ok, why = compare(m, g, xy(8))
p = plan_of(g)
graphs = [s for s in p.segments if s.graph is not None] if p is not None else []
good = len(graphs) == 2 and getattr(graphs[1], "launch", graphs[1].first) == graphs[1].first \
    and p.divergences == 0 \
    and p.replays == 2 * 6
check(ok and good, "[control] C7 a later segment reads an earlier one's outputs in place "
      f"[{describe(g)}]", why or "segments")


class Refused(nn.Module):
    """A one-call segment (refused) before a boundary; the next segment reads its output (turned
    into a copy at capture: its launch is after it) and y."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        a = x * 2
        n = a.tolist()[0][0]
        b = a * self.w
        c = b.tanh()
        d = c + y
        e = d.sigmoid() * 2.0
        if n > 1e30:
            e = e * 0
        return e * e.sum().item()


torch.manual_seed(0)
m = Refused().to(DEV).eval()
g = graphed(m)
ok, why = compare(m, g, xy(6))
p = plan_of(g)
graphs = [s for s in p.segments if s.graph is not None] if p is not None else []
good = len(graphs) == 1 and {i for i, _ in graphs[0].bufs} == \
    {graphs[0].first, getattr(graphs[0], "launch", max(i for i, _ in graphs[0].bufs))}
check(ok and good, "[control] C8 a P ref into a refused segment, copied: the launch after it "
      f"[{describe(g)}]", why or "segments")


class Autocast(nn.Module):
    """Segments back to back (autocast on for the middle one): no boundary between them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, y):
        a = self.fc(x)
        b = a.relu()
        with torch.autocast(DEV, dtype=torch.bfloat16):
            c = self.fc(b)
            d = c + y
            e = d * 2
        return e.float() * e.float().sum().item()


torch.manual_seed(0)
m = Autocast().to(DEV).eval()
g = graphed(m)
ok, why = compare(m, g, xy(6))
p = plan_of(g)
good = p is not None and sum(s.graph is not None for s in p.segments) >= 2 and \
    p.divergences == 0
check(ok and good, f"[control] C9 segments back to back (autocast) [{describe(g)}]",
      why or "segments")
