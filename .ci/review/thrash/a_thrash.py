"""d21c591: a key whose graph was evicted twice runs eagerly for good (GraphCache.thrashing).
Findings: the marks never decay and count evictions of graphs that replayed for long (phases),
of stale variants (an attribute set anew), and outlive the graphs (invalidation,
capture_sizes, a shared policy's next module); the thrash EagerEntry shadows a key's other
variants' graphs; the reason names the wrong max_graphs in a region; _MAX_RECAPTURES=2 leaves
a nested head's third blocked signature eager for good (synthetic nesting). See common.py."""
import copy
import gc

import torch

import cudagraphify as cg
from common import (DEV, FAILS, check, counts, delta, info, rule_off, run, stack, sync,
                    timed)

THRASH = "evicted 2 times before"


def commit_cycle():
    ref, g = stack(max_graphs=4)
    bad = run(ref, g, range(1, 7), rounds=40)
    s = cg.stats(g)
    check(bad == 0 and s.captures <= 12 and s.replays >= 150,
          "[control] six sizes through max_graphs=4 (the commit's case): bitwise, graphs replay",
          f"bad={bad} captures={s.captures} replays={s.replays} eager={sum(s.eager_calls.values())}")


def phases(off=False):
    """Sizes {1,2,3} and {4,5,6} in turn, 100 rounds a phase: each fits max_graphs=4."""
    ref, g = stack(max_graphs=4)
    bad = 0
    for phase in range(6):
        bad += run(ref, g, [1, 2, 3] if phase % 2 == 0 else [4, 5, 6], rounds=100)
    before = counts(g)
    bad += run(ref, g, [1, 2, 3], rounds=50)
    c, r, e = delta(g, before)
    xs = [torch.randn(n, 256, device=DEV) for n in (1, 2, 3)]
    t = timed(lambda: [g(x) for _ in range(100) for x in xs]) / 300
    te = timed(lambda: [ref(x) for _ in range(100) for x in xs]) / 300
    return bad, c, r, e, t, te


def f1_phases():
    bad, c, r, e, t, te = phases()
    check(bad == 0 and e == 0 and r >= 145,
          "[finding] two working sets that each fit max_graphs=4, in turn: the seventh phase "
          "replays", f"bad={bad} captures={c} replays={r} eager={e} (of 150)")
    with rule_off():
        bad0, c0, r0, e0, t0, _ = phases(off=True)
    info(f"phase 7 per call: {t * 1e6:.0f} us (rule on), {t0 * 1e6:.0f} us (rule off: "
         f"captures={c0} replays={r0} eager={e0}, bad={bad0}), eager twin {te * 1e6:.0f} us")


def f2_variants():
    torch.manual_seed(0)
    ref, g = stack(max_graphs=2)
    bad = 0
    for _ in range(3):
        before = counts(g)
        for v in range(3):
            ref.scale = g.scale = float(v + 1)
            bad += run(ref, g, [4], rounds=50)
        c, r, e = delta(g, before)
    graphs = cg.stats(g).graphs
    check(bad == 0 and r > 0, "[finding] three values of an attribute (variants of one key), "
          "max_graphs=2: the two graphs kept replay in the third round",
          f"bad={bad} graphs kept={graphs} captures={c} replays={r} eager={e} (of 150)")


def attribute(off=False):
    ref, g = stack()
    bad, out = 0, []
    for change in range(5):
        ref.scale = g.scale = 1.0 + change / 8
        before = counts(g)
        bad += run(ref, g, range(1, 9), rounds=20)
        out.append(delta(g, before))
    return bad, out


def f3_attribute():
    bad, out = attribute()
    c, r, e = out[-1]
    check(bad == 0 and r >= 150, "[finding] default max_graphs=16, eight sizes, an attribute "
          "set to a new value a fifth time: the fifth value's calls replay",
          f"bad={bad} per value (captures, replays, eager of 160): {out}")
    with rule_off():
        bad0, out0 = attribute(off=True)
    info(f"rule off: bad={bad0} per value {out0}")


def f4_invalidation():
    ref, g = stack(max_graphs=4)
    bad = run(ref, g, range(1, 7), rounds=3)
    g.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, assign=True)
    done = cg.capture_sizes(g, lambda n: torch.randn(n, 256, device=DEV), [1, 2, 3, 4],
                            progress=False)
    before = counts(g)
    bad += run(ref, g, [1, 2, 3, 4], rounds=25)
    c, r, e = delta(g, before)
    check(bad == 0 and not done.eager and e == 0,
          "[finding] after parameters moved (every graph dropped), capture_sizes of four sizes "
          "with max_graphs=4 graphs them all",
          f"bad={bad} invalidations={cg.stats(g).invalidations} graphed={done.graphed} "
          f"eager={list(done.eager)}; then captures={c} replays={r} eager={e} (of 100)")


def f4_shared():
    policy = cg.CachePolicy(max_graphs=2, shared=True)
    ref_a, a = stack(cache_policy=policy)
    bad = run(ref_a, a, [1, 2, 3], rounds=3)
    del a
    gc.collect()
    torch.manual_seed(1)
    ref_c, c = stack(cache_policy=policy)
    bad += run(ref_c, c, [1, 2], rounds=20)
    s = cg.stats(c)
    thrash = sum(v for k, v in s.eager_calls.items() if THRASH in k)
    check(bad == 0 and thrash == 0, "[finding] a shared policy's next module (the first one "
          "deleted) graphs its two sizes with max_graphs=2",
          f"bad={bad} captures={s.captures} replays={s.replays} thrash-eager={thrash} (of 40)")


def f6_region():
    ref, g = stack()
    bad = 0
    with cg.graph_region(max_graphs=2):
        for _ in range(4):
            for n in (1, 2, 3):
                x = torch.randn(n, 256, device=DEV)
                bad += not torch.equal(g(x).clone(), ref(x))
    reasons = [r for r in cg.stats(g).eager_calls if THRASH in r]
    check(bad == 0 and reasons and all("max_graphs=2 " in r for r in reasons),
          "[finding] in graph_region(max_graphs=2) the thrash reason names max_graphs=2",
          f"bad={bad} reason: {reasons[0][:150] if reasons else None}")


def control_invalidations():
    ref, g = stack(max_graphs=4)
    bad = 0
    for _ in range(8):
        bad += run(ref, g, [1, 2, 3], rounds=2)
        g.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, assign=True)
    s = cg.stats(g)
    check(bad == 0 and not any(THRASH in r for r in s.eager_calls) and s.invalidations >= 7,
          "[control] invalidations (parameters moved eight times) are not evictions",
          f"bad={bad} invalidations={s.invalidations} eager={dict(s.eager_calls)}")


class _Growing:
    def __init__(self):
        self.keys = None

    def update(self, k):
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=1)
        return self.keys


class _Cache:
    """Its layers' growing keys (as HF's DynamicCache holds them): an opaque argument."""

    def __init__(self):
        self.layers = [_Growing(), _Growing()]


class _Model(torch.nn.Module):
    """tests/test_opaque_plan.py's shape: layers that read and grow an opaque cache."""

    def __init__(self):
        super().__init__()
        self.k = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(2)])
        self.mlp = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(2)])

    def forward(self, x, cache):
        for k, mlp, c in zip(self.k, self.mlp, cache.layers):
            keys = c.update(k(x))
            x = x + torch.softmax(x @ keys.transpose(1, 2), -1) @ keys
            x = x + mlp(x)
        return x


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model, self.norm = _Model(), torch.nn.LayerNorm(64)

    def forward(self, x, cache):
        return self.norm(self.model(x, cache))


class _Wrap(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, cache):
        return self.inner(x, cache)


class _Top(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = _Wrap(_Wrap(_Inner())), torch.nn.Linear(64, 32)

    def forward(self, x, cache):
        return self.head(self.inner(x, cache)[:, -1:, :])


def f7_recaptures():
    torch.manual_seed(0)
    ref = _Top().to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    caches = {b: (_Cache(), _Cache()) for b in (1, 2, 3)}
    bad = 0
    for t in range(45):
        b = t % 3 + 1
        rc, c = caches[b]
        x = torch.randn(b, 1, 64, device=DEV)
        bad += not torch.equal(g(x, c), ref(x, rc))
    head = cg.stats(g.head)
    eager = sum(head.eager_calls.values())
    check(bad == 0 and eager <= 3, "[finding] (low) a head three plans above the norm it reads, "
          "batch sizes 1-3 in turn: at most 3 eager head calls (_MAX_RECAPTURES 8 -> 2)",
          f"bad={bad} head captures={head.captures} replays={head.replays} eager={eager} of 45")


def main():
    info(f"device {DEV} ({torch.cuda.get_device_name() if DEV.startswith('cuda') else 'CPU double'})")
    with torch.no_grad():
        for step in (commit_cycle, control_invalidations, f1_phases, f2_variants, f3_attribute,
                     f4_invalidation, f4_shared, f6_region, f7_recaptures):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - one line per check
                check(False, f"{step.__name__} raised", f"{type(e).__name__}: {e}")
    sync()
    info(f"a_thrash done: {len(FAILS)} FAIL line(s)")


if __name__ == "__main__":
    main()
