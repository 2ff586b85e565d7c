"""Controls (expected: PASS lines; INFO lines are measurements).

Demotion (b8e0eed) with HF's own sliding-window layers, and the recapture of a region graph
blocked by a later graph's held output (c6fd56d), on real memory: every value and every held
view compared with an eager twin, bitwise."""
from common import (demoted, DEV, DTYPE, GEN, SIDE, DynamicCache, _engine, _state, cg, check,
                    copy, count, guarded, hf, ids, info, nn, same_cache, same_generate,
                    static, stats, sync, torch)
import time


def sliding_generate(kind):
    def run():
        ref, _ = hf(kind)
        g = cg.graphify(copy.deepcopy(ref))
        bad = None
        for n, (batch, length) in enumerate([(1, 4), (1, 9), (2, 4), (1, 4), (1, 7)]):
            x = ids(batch, length, 20 + n)
            want = ref.generate(x, cache_implementation="static", disable_compile=True, **GEN)
            got = g.generate(x, cache_implementation="static", **GEN)
            if bad is None and not same_generate(got, want):
                bad = f"generate {n} (batch {batch}, prompt {length}) differs"
        mlp = cg.stats(g.model.layers[0].mlp)
        check(bad is None, f"{kind}: generate(cache_implementation='static') with sliding "
              "layers, prompts past the window, batch 2: tokens and logits",
              f"{bad or 'bitwise equal'}; mlp piece replays={mlp.replays}; {stats(g)}")
    return run


def kept_cache_reset():
    ref, config = hf("qwen2")
    g = cg.graphify(copy.deepcopy(ref))
    rc, c = static(config, 32), static(config, 32)
    bad = None
    for n in range(4):
        x = ids(1, 5, 30 + n)
        if n == 2:  # a DynamicCache generation in between
            want = ref.generate(x, past_key_values=DynamicCache(config=config),
                                disable_compile=True, **GEN)
            got = g.generate(x, past_key_values=DynamicCache(config=config), **GEN)
        else:
            rc.reset()
            c.reset()
            want = ref.generate(x, past_key_values=rc, disable_compile=True, **GEN)
            got = g.generate(x, past_key_values=c, **GEN)
            if bad is None and not same_cache(rc, c):
                bad = f"generation {n}: cache contents differ"
        if bad is None and not same_generate(got, want):
            bad = f"generation {n}: tokens or logits differ"
    check(bad is None and demoted(c) and count(g, SIDE, own=True) == 2,
          "a kept sliding StaticCache reset between generations (a DynamicCache one between)",
          f"{bad or 'bitwise equal'}; demoted={demoted(c)}; {stats(g)}")


def two_models_one_cache():
    m1, config = hf("qwen2", 0)
    m2, _ = hf("qwen2", 1)
    g1, g2 = cg.graphify(copy.deepcopy(m1)), cg.graphify(copy.deepcopy(m2))
    rc, c = static(config), static(config)
    x, bad = ids(1, 4, 40), None
    for t in range(10):
        ref, g = (m1, g1) if t % 2 == 0 else (m2, g2)
        want = ref(x, past_key_values=rc, use_cache=True).logits
        got = g(x, past_key_values=c, use_cache=True).logits
        if bad is None and not (torch.equal(got, want) and same_cache(rc, c)):
            bad = f"step {t} differs"
        x = want[:, -1:].argmax(-1)
    check(bad is None and demoted(c), "two models decoding alternately on one sliding "
          "StaticCache", f"{bad or 'bitwise equal'}; {stats(g1)} / {stats(g2)}")


def dead_cache_id():
    ref, config = hf("qwen2")
    g = cg.graphify(copy.deepcopy(ref))
    before = len(_state._changing)
    bad = None
    for n in range(3):
        rc, c = static(config, 16), static(config, 16)
        x = ids(1, 4, 50 + n)
        for t in range(3):
            want = ref(x, past_key_values=rc, use_cache=True).logits
            got = g(x, past_key_values=c, use_cache=True).logits
            if bad is None and not torch.equal(got, want):
                bad = f"cache {n} step {t} differs"
            x = want[:, -1:].argmax(-1)
        if not demoted(c):
            bad = bad or f"cache {n} not demoted"
        rc = c = None
        import gc
        gc.collect()
        fresh = static(config, 16)
        if demoted(fresh) or len(_state._changing) != before:
            bad = bad or f"cache {n}: a new cache inherits a dead one's demotion"
        del fresh
    check(bad is None, "demoted caches die, new ones (often at their address) are static state",
          bad or "ok")


def _linears(d):
    torch.manual_seed(0)
    f, g = nn.Linear(d, d).to(DEV, DTYPE), nn.Linear(d, d).to(DEV, DTYPE)
    return (copy.deepcopy(f), copy.deepcopy(g)), (cg.graphify(f), cg.graphify(g))


def region_recapture():
    """F then G (G reads F's output in place); a view of G's output is kept across the next
    F call: F is released and captured again after G. Big tensors and allocations between
    calls, so that freed memory is handed out again; every kept view checked each step."""
    (rf, rg), (gf, gg) = _linears(512)
    kept, bad = [], None
    with cg.graph_region():
        view = rview = None
        for t in range(30):
            x = torch.randn(256, 512, device=DEV, dtype=DTYPE)
            a, ra = gf(x), rf(x)
            churn = [torch.randn(256, 512, device=DEV, dtype=DTYPE) for _ in range(3)]
            b, rb = gg(a), rg(ra)
            if view is not None:
                kept.append((view, rview))
            view, rview = b[:8], rb[:8]
            del a, b, churn
            kept = kept[-4:]
            sync()
            if bad is None and not all(torch.equal(v, w) for v, w in kept + [(view, rview)]):
                bad = f"step {t}: a kept view differs"
    s = cg.stats(gf)
    check(bad is None and s.replays >= 20,
          "region: F blocked by a view of G's output, captured again after G, then replays",
          f"{bad or 'bitwise equal'}; recaptures={gf._cudagraphify_state._recaptures}; "
          f"F {stats(gf)}; G {stats(gg)}")


def ping_pong():
    (rf, rg), (gf, gg) = _linears(512)
    bad = None
    with cg.graph_region():
        vb = rvb = None
        for t in range(30):
            x = torch.randn(128, 512, device=DEV, dtype=DTYPE)
            y = torch.randn(128, 512, device=DEV, dtype=DTYPE)
            a, ra = gf(x), rf(x)
            va, rva = a[:4], ra[:4]
            del a, vb
            b, rb = gg(y), rg(y)
            vb, rvb = b[:4], rb[:4]
            del b
            sync()
            if bad is None and not (torch.equal(va, rva) and torch.equal(vb, rvb)):
                bad = f"step {t}: a held view differs"
            del va
    caps = [cg.stats(m).captures for m in (gf, gg)]
    bound = 1 + _engine._MAX_RECAPTURES
    check(bad is None and max(caps) <= bound,
          "region ping-pong (each graph blocked by the other's held view): bounded recaptures",
          f"{bad or 'bitwise equal'}; captures F,G={caps} (bound {bound}); "
          f"F {stats(gf)}; G {stats(gg)}")


def own_output_held():
    """F is released (blocked by a view of G's output) while the caller holds F's own output:
    it is moved to a copy; views of it taken afterwards, and every later output, keep
    eager's values while F and G replay on the region's memory."""
    (rf, rg), (gf, gg) = _linears(512)
    bad = None
    with cg.graph_region():
        x = torch.randn(256, 512, device=DEV, dtype=DTYPE)
        a0, ra0 = gf(x), rf(x)
        b0, rb0 = gg(a0), rg(ra0)
        vb, rvb = b0[:8], rb0[:8]
        del b0
        a1, ra1 = gf(x * 2), rf(x * 2)  # F blocked by vb: released; a0 moved to a copy
        va0, rva0 = a0[5:9], ra0[5:9]
        for t in range(10):
            y = torch.randn(256, 512, device=DEV, dtype=DTYPE)
            a, ra = gf(y), rf(y)
            churn = [torch.randn(256, 512, device=DEV, dtype=DTYPE) for _ in range(2)]
            b, rb = gg(a), rg(ra)
            sync()
            pairs = [(a, ra), (b, rb), (a0, ra0), (va0, rva0), (vb, rvb), (a1, ra1)]
            if bad is None and not all(torch.equal(p, q) for p, q in pairs):
                bad = f"step {t}: an output differs"
            del a, b, churn
    rec = gf._cudagraphify_state._recaptures
    check(bad is None and rec == 1, "region: F released while the caller holds its output",
          f"{bad or 'bitwise equal'}; recaptures={rec}; F {stats(gf)}")


def dynamic_generate():
    ref, _ = hf("llama")
    g = cg.graphify(copy.deepcopy(ref))
    bad = None
    for n, length in enumerate((4, 6, 4)):
        x = ids(1, length, 60 + n)
        want = ref.generate(x, disable_compile=True, **GEN)  # (a DynamicCache)
        got = g.generate(x, **GEN)
        if bad is None and not same_generate(got, want):
            bad = f"generate {n} differs"
    head = cg.stats(g.lm_head)
    check(bad is None and head.replays >= 8, "llama generate with a DynamicCache (the head "
          "reads a view of the final norm: captured again after it)",
          f"{bad or 'bitwise equal'}; lm_head {stats(g.lm_head)} recaptures="
          f"{g.lm_head._cudagraphify_state._recaptures}")


def timing():
    ref, config = hf("qwen2")
    g = cg.graphify(copy.deepcopy(ref))

    def loop(model, steps=24):
        c = static(config, 64)
        x = ids(1, 4, 70)
        model(x, past_key_values=c, use_cache=True)
        x = x[:, -1:]
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            model(x, past_key_values=c, use_cache=True)
        sync()
        return (time.perf_counter() - t0) / steps * 1e3

    loop(g)  # (the pieces are planned and captured on the first cache)
    e, q = loop(ref), loop(g)
    info("qwen2 sliding StaticCache decode step, demoted (pieces around it)",
         f"eager {e:.2f} ms, graphify {q:.2f} ms ({q / e:.2f}x) on {DEV}")


guarded("qwen2 sliding generate", sliding_generate("qwen2"))
guarded("mistral sliding generate", sliding_generate("mistral"))
guarded("a kept sliding StaticCache reset", kept_cache_reset)
guarded("two models, one sliding cache", two_models_one_cache)
guarded("dead demoted caches", dead_cache_id)
guarded("region recapture", region_recapture)
guarded("region ping-pong", ping_pong)
guarded("region: own output held", own_output_held)
guarded("llama DynamicCache generate", dynamic_generate)
guarded("timing", timing)
