"""Shared-trial checks on a GPU. Findings (FAIL on the change, PASS before it):
T1 a give-back verdict deferred while the twin is pending never comes in the differential
bench's pattern (each output kept until the next call returns) or with one output kept: the
piece is timed forever (a device sync every timed call). T2 a per-signature give-back discards
another guard's kept graph of the key. Controls: values bitwise, gradients within TOL."""
import random
import time

from common import (DEV, FORCE, SIM, cg, check, grads_close, info, on_trial, pair, pieces,
                    state, torch, x_)
from torch import nn


def bench_pattern(g, ref, calls, n=16):
    kept = None
    with torch.enable_grad():
        for i in range(calls):
            x = x_(n)
            out, want = g(x), ref(x)
            if not torch.equal(out, want):
                return f"call {i}: output differs from eager"
            kept = out  # noqa: F841 - held over the next call
    return None


def t1_bench(other_signature):
    FORCE["verdict"] = "give"
    ref, g = pair()
    if other_signature:
        FORCE["verdict"] = "keep"
        with torch.no_grad():
            for _ in range(10):
                x = x_(8)
                if not torch.equal(g(x), ref(x)):
                    return "no_grad output differs"
        FORCE["verdict"] = "give"
    base = {id(p): state(p).timed_calls if state(p) else 0 for p in pieces(g)}
    bad = bench_pattern(g, ref, 40)
    if bad:
        return bad
    for p in pieces(g):
        st = state(p)
        n = st.timed_calls - base[id(p)]
        if on_trial(st) or n > 6:
            return f"still on trial after 40 calls: {n} timed calls (before the change: 3)"
    return None


def t1_one_kept():
    FORCE["verdict"] = "give"
    ref, g = pair()
    with torch.enable_grad():
        for _ in range(2):
            x = x_()
            g(x), ref(x)
        x0 = x_()
        logged, want0 = g(x0), ref(x0)
        for i in range(30):
            x = x_()
            if not torch.equal(g(x), ref(x)):
                return f"call {i}: output differs"
        n = state(g.a).timed_calls
        logged.sum().backward(), want0.sum().backward()
    bad = grads_close(g, ref)
    if bad:
        return bad
    return None if n <= 6 else f"{n} timed calls in 30 behind one kept output (before: 3)"


class KBlock(Block := __import__("common").Block):
    def __init__(self):
        super().__init__()
        self.k = 0

    def forward(self, x):
        return super().forward(x) * (self.k + 1)


class KRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = KBlock(), KBlock()

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):
            y = y + 1
        return self.b(y)


def t2_guard():
    ref, g = pair(KRoot)

    def calls(n, rows, k, verdict):
        FORCE["verdict"] = verdict
        for m in (g, ref):
            m.a.k = k
        with torch.no_grad():
            for _ in range(n):
                x = x_(rows)
                if not torch.equal(g(x), ref(x)):
                    raise AssertionError(f"k={k}: output differs")

    calls(10, 8, 0, "keep")
    calls(10, 16, 0, "keep")
    calls(10, 16, 1, "give")
    st = state(g.a)
    c, t = st.captures, st.timed_calls
    calls(10, 16, 0, "give")  # (a new trial of k=0 would give it back: shows as a change)
    if (st.captures, st.timed_calls) != (c, t):
        return (f"k=0's kept graph was discarded: {st.captures - c} capture(s), "
                f"{st.timed_calls - t} timed call(s) again")
    return None


def c_keep_bench():
    FORCE["verdict"] = "keep"
    ref, g = pair()
    bad = bench_pattern(g, ref, 30)
    if bad:
        return bad
    for p in pieces(g):
        st = state(p)
        if on_trial(st) or st.given_back is not None:
            return f"trial not over / given back: {st.given_back}"
        if any("has not run yet" in r for r in st.eager_calls):
            return f"calls ran eagerly behind the kept output: {dict(st.eager_calls)}"
    return None


def c_accumulate(verdict, micro):
    FORCE["verdict"] = verdict
    ref, g = pair()
    og, orf = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(10):
        lg = lr = 0
        for _ in range(micro):
            x = x_()
            o, w = g(x), ref(x)
            if not torch.equal(o, w):
                return f"step {step}: output differs"
            lg, lr = lg + o.square().mean(), lr + w.square().mean()
        lg.backward(), lr.backward()
        bad = grads_close(g, ref)
        if bad:
            return f"step {step}: {bad}"
        # (each step from the same weights: no SGD drift of an ulp's difference)
        g.zero_grad(), ref.zero_grad()
    for p in pieces(g):
        st = state(p)
        if (st.given_back is None) != (verdict == "keep") or on_trial(st):
            return f"verdict {verdict}: given_back={st.given_back}, on trial {len(on_trial(st))}"
    return None


def c_random(seed):
    rng = random.Random(seed)
    FORCE["verdict"] = rng.choice(["give", "keep", None])
    ref, g = pair(max_graphs=rng.choice([3, 16]))
    kept = []
    for i in range(40):
        op = rng.random()
        if op < 0.5:
            x = x_(rng.choice([8, 16]), grad=rng.random() < 0.3)
            y = x.detach().clone().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                o, w = g(x), ref(y)
            if not torch.equal(o, w):
                return f"op {i}: output differs"
            if rng.random() < 0.6:
                kept.append((o, w, x, y))
        elif op < 0.8 and kept:
            o, w, x, y = kept.pop(rng.randrange(len(kept)))
            try:
                if x.requires_grad:
                    a = torch.autograd.grad(o.sum(), [x])[0]
                    b = torch.autograd.grad(w.sum(), [y])[0]
                    if not torch.allclose(a, b, rtol=2e-5, atol=2e-6):
                        return f"op {i}: input gradient differs"
                else:
                    g.zero_grad(), ref.zero_grad()
                    o.square().mean().backward(), w.square().mean().backward()
                    bad = grads_close(g, ref)
                    if bad:
                        return f"op {i}: {bad}"
            except cg.CudagraphifyError as e:
                if "released" not in str(e):
                    raise
        elif op < 0.9:
            with torch.no_grad():
                x = x_(8)
                if not torch.equal(g(x), ref(x)):
                    return f"op {i}: no_grad output differs"
        elif kept:
            kept.pop(0)
    return None


def timing():
    """INFO: the bench pattern with the real verdict, graphed vs eager, ms per call."""
    FORCE["verdict"] = None
    ref, g = pair()
    bench_pattern(g, ref, 20)
    for name, m in (("graphed", g), ("eager", ref)):
        kept = None
        with torch.enable_grad():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                kept = m(x_())  # noqa: F841
            torch.cuda.synchronize()
        info(f"bench pattern {name}: {(time.perf_counter() - t) * 20:.3f} ms a call")
    info("verdicts: " + "; ".join(f"{n}={state(p).given_back or 'kept'}"[:90]
                                  + f" timed={state(p).timed_calls}"
                                  + f" on_trial={len(on_trial(state(p)))}"
                                  for n, p in (("a", g.a), ("b", g.b))))


check("T1 bench pattern: a give-back verdict comes (whole piece)", lambda: t1_bench(False))
check("T1 bench pattern: a give-back verdict comes (per signature)", lambda: t1_bench(True))
check("T1 one output kept: the twin is not timed forever", t1_one_kept)
check("T2 per-signature give-back keeps another guard's kept graph", t2_guard)
check("control: keep verdict in the bench pattern ends the shared trial", c_keep_bench)
for verdict in ("give", "keep"):
    for micro in (2, 3):
        check(f"control: accumulation micro={micro} verdict={verdict}",
              lambda: c_accumulate(verdict, micro))
for seed in range(6):
    check(f"control: random interleaving seed={seed}", lambda: c_random(seed))
if not SIM:
    timing()
