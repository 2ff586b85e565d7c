"""Findings of the review of d62294e on a GPU (expected FAIL on d62294e; PASS once fixed).
tests/test_review_inflight.py has the CPU side (same ids)."""
from common import DEV, cg, check, grads_close, mlp, pair, torch, nn


def accumulate(g, ref, shapes, steps=3):
    for step in range(steps):
        lg = lr = 0
        for n in shapes:
            x = torch.randn(n, 64, device=DEV)
            o, w = g(x), ref(x)
            if not torch.equal(o, w):
                return f"step {step}: output differs"
            lg, lr = lg + o.sum(), lr + w.sum()
        lg.backward(), lr.backward()
        bad = grads_close(g, ref)
        if bad:
            return f"step {step}: {bad}"
        g.zero_grad(), ref.zero_grad()
    return None


# F1 (crash): the second graph's cache.put evicts a graph whose backward is pending
check("F1 max_graphs=1, two micro-batches of one shape: no error, eager's gradients",
      lambda: accumulate(*pair(mlp, max_graphs=1)[::-1], [16, 16]))
check("F1 max_graphs=2, micro-batches of shapes a,a,b: no error, eager's gradients",
      lambda: accumulate(*pair(mlp, max_graphs=2)[::-1], [16, 16, 24]))


# F5 (speed): second graphs count against max_graphs: 9 shapes x 2 micro-batches evict
def nine_shapes():
    ref, g = pair(mlp)
    for step in range(3):
        for n in range(1, 10):
            bad = accumulate(g, ref, [8 * n, 8 * n], steps=1)
            if bad:
                return bad
    s = cg.stats(g)
    return None if s.evictions == 0 else \
        f"{s.evictions} evictions, {s.captures} captures for 9 signatures"


check("F5 nine shapes x two micro-batches under max_graphs=16: no eviction", nine_shapes)


# F2 (speed, leak): eviction budget spent: a call in flight puts an eager entry before the graph
def budget():
    ref, g = pair(mlp, cache_policy=cg.CachePolicy(max_graphs=1, max_evictions=1))
    x5, x3 = torch.randn(40, 64, device=DEV), torch.randn(24, 64, device=DEV)
    g(x5).sum().backward()
    g(x3).sum().backward()  # evicts the first graph: the budget is spent
    g(x3).sum().backward()
    held = g(x3)
    g(x3)  # in flight: eager
    held.sum().backward()
    r = cg.stats(g).replays
    y = g(x3)
    if not torch.equal(y, ref(x3)):
        return "output differs"
    return None if cg.stats(g).replays == r + 1 else \
        f"the graph no longer replays: {cg.stats(g).eager_calls}"


check("F2 eviction budget spent: the signature's graph replays again once free", budget)


# F4 (wrong values: silent where eager raises): a replay of the second graph writes a buffer
# the first graph's backward saved, without moving its version counter
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("scale", torch.ones(64))

    def forward(self, x):
        self.scale.mul_(0.5)
        return self.lin(x) * self.scale


def written_buffer(shapes):
    torch.manual_seed(0)
    ref = Scaled().to(DEV)
    g = cg.graphify(Scaled().to(DEV))
    for n in sorted(set(shapes)):
        g(torch.randn(n, 64, device=DEV)).sum().backward()
    eager = graphed = None
    for model in (ref, g):
        for step in range(3):
            try:
                sum(model(torch.randn(n, 64, device=DEV)).sum() for n in shapes).backward()
                res = "no error"
            except RuntimeError as e:
                res = "inplace" if "inplace" in str(e) else str(e)[:80]
            if model is ref:
                eager = res
            elif res != eager:
                graphed = f"step {step}: {res}"
    return None if graphed is None else f"eager: {eager}; graphed {graphed}"


check("F4 same signature: a buffer written by forward and saved for backward raises as eager",
      lambda: written_buffer([16, 16]))
check("F4b (pre-existing) two signatures: the same buffer raises as eager",
      lambda: written_buffer([16, 24]))
