"""Findings on b8e0eed (expected: FAIL lines on the reviewed code; the values themselves are
checked too and should PASS: these are lost graphs, not wrong results).

F1: FirstCall.warm_up picks the changed object with ``next(... if not StateGuard([],
objects=[(where, obj)]).valid() ..., passed[0])``. A guard built after the call is always
valid, so it is always passed[0], and b8e0eed demotes that object for as long as it lives, for
every callable.
F2: a cache whose Python state changes once (a flag set by its first decode step) is demoted
for good. Before b8e0eed the whole model graphed after one eager call."""
from common import (demoted, DEV, OPAQUE, SIDE, cg, check, copy, count, guarded, hf, ids, info,
                    nn, root, static, stats, sync, torch)
import time


class Two(nn.Module):
    """One forward given two static caches (a target's and a draft's, say)."""

    def __init__(self, m1, m2):
        super().__init__()
        self.m1, self.m2 = m1, m2

    def forward(self, x, ca, cb):
        return (self.m1(x, past_key_values=ca, use_cache=True).logits
                + self.m2(x, past_key_values=cb, use_cache=True).logits)


def f1_second_cache_set_up():
    m1, config = hf("llama", 0)
    m2, _ = hf("llama", 1)
    ref = Two(m1, m2)
    g = cg.graphify(copy.deepcopy(ref))
    rca, ca = static(config), static(config)
    bad = None
    for n in range(3):  # a persistent cache ca, a new cache cb per request
        rcb, cb = static(config), static(config)
        x = ids(1, 1, n)  # (one-token calls: no prefill path)
        for t in range(4):
            want, got = ref(x, rca, rcb), g(x, ca, cb)
            if bad is None and not torch.equal(got, want):
                bad = f"request {n} step {t}: logits differ"
            x = want[:, -1:].argmax(-1)
    check(bad is None, "F1 two static caches, a new second one per request: values as eager's",
          bad or "bitwise equal")
    check(not demoted(ca) and count(g, OPAQUE, own=True) == 0,
          "F1 a cache that never changes is not demoted by a second cache's lazy set-up",
          f"ca demoted={demoted(ca)}; {stats(g)}")


class WithAux(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, cache, aux):
        return self.m(x, past_key_values=cache, use_cache=True).logits + aux.bias


class Aux:
    def __init__(self):
        self.bias = torch.zeros(1, 1, 256, device=DEV)


def f1_static_argnames_object():
    m, config = hf("qwen2")
    ref = WithAux(m)
    g = cg.graphify(copy.deepcopy(ref), static_argnames=("aux",))
    rc, c, aux = static(config), static(config), Aux()
    x, bad, steps = ids(1, 1, 7), None, 12
    times = []
    for t in range(steps):
        sync()
        t0 = time.perf_counter()
        want = ref(x, rc, aux)
        sync()
        t1 = time.perf_counter()
        got = g(x, c, aux=aux)
        sync()
        times.append((t1 - t0, time.perf_counter() - t1))
        if bad is None and not torch.equal(got, want):
            bad = f"step {t}: logits differ"
        x = want[:, -1:].argmax(-1)
    check(bad is None, "F1 sliding cache beside a static_argnames object: values as eager's",
          bad or "bitwise equal")
    late = times[4:]
    eager_ms = sum(a for a, _ in late) / len(late) * 1e3
    graph_ms = sum(b for _, b in late) / len(late) * 1e3
    info("F1 sliding cache beside a static_argnames object: decode step",
         f"eager {eager_ms:.2f} ms, graphify {graph_ms:.2f} ms ({graph_ms / eager_ms:.2f}x)")
    check(demoted(c) and count(g, SIDE, own=True) <= 2,
          "F1 a sliding cache beside a static_argnames object is demoted (no probe per step)",
          f"demoted={demoted(c)}; probed steps ending 'side effect'="
          f"{count(g, SIDE, own=True)} of {steps}; {stats(g)}")


class Once(nn.Module):
    """Sets a flag on the cache at its first decode step, and never changes it again (as HF's
    has_previous_state or EncoderDecoderCache.is_updated)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, cache):
        if cache.is_initialized and not getattr(cache, "warm", False):
            cache.warm = True
        return self.m(x, past_key_values=cache, use_cache=True).logits


def f2_once():
    m, config = hf("llama")
    ref = Once(m)
    g = cg.graphify(copy.deepcopy(ref))
    rc, c = static(config), static(config)
    x, bad, steps, times = ids(1, 1, 3), None, 16, []
    for t in range(steps):
        sync()
        t0 = time.perf_counter()
        want = ref(x, rc)
        sync()
        t1 = time.perf_counter()
        got = g(x, c)
        sync()
        times.append((t1 - t0, time.perf_counter() - t1))
        if bad is None and not torch.equal(got, want):
            bad = f"step {t}: logits differ"
        x = want[:, -1:].argmax(-1)
    check(bad is None, "F2 a flag set once on a static cache: values as eager's",
          bad or "bitwise equal")
    late = times[6:]
    eager_ms = sum(a for a, _ in late) / len(late) * 1e3
    graph_ms = sum(b for _, b in late) / len(late) * 1e3
    info("F2 a flag set once on a static cache: decode step after it",
         f"eager {eager_ms:.2f} ms, graphify {graph_ms:.2f} ms ({graph_ms / eager_ms:.2f}x)")
    s = root(g)
    check(sum(s.eager_calls.values()) <= 2,
          "F2 a static cache whose Python state changed once graphs again afterwards",
          f"root eager calls={sum(s.eager_calls.values())} of {steps}; demoted="
          f"{demoted(c)}; {stats(g)}")


def f2_kind():
    """With 99043f9: after two caches of a kind whose Python state changed (once each), every
    new cache of that kind is demoted before its first call: never one graph of the model."""
    m, config = hf("llama")
    ref = Once(m)
    g = cg.graphify(copy.deepcopy(ref))
    bad, replays = None, []
    for n in range(3):
        rc, c = static(config), static(config)
        x = ids(1, 1, 80 + n)
        before = root(g).replays
        for t in range(8):
            want, got = ref(x, rc), g(x, c)
            if bad is None and not torch.equal(got, want):
                bad = f"cache {n} step {t}: logits differ"
            x = want[:, -1:].argmax(-1)
        replays.append(root(g).replays - before)
    check(bad is None, "F2 three caches whose flag is set once: values as eager's",
          bad or "bitwise equal")
    check(replays[-1] >= 5, "F2 the third cache whose flag is set once graphs after it "
          "(before b8e0eed: 6 of 8 steps replayed)",
          f"whole-model replays per cache={replays}; {stats(g)}")


guarded("F1 two static caches, a new second one per request", f1_second_cache_set_up)
guarded("F1 sliding cache beside a static_argnames object", f1_static_argnames_object)
guarded("F2 a flag set once on a static cache", f2_once)
guarded("F2 three caches whose flag is set once", f2_kind)
