"""Review guard12 (024d847): a set-up cache allocated in the set-up's own CUDA MemPool, and
the graphs of a dead pooled cache kept. Prints PASS/FAIL/INFO lines; under 60 s on one GPU.

Run from the repository root: ``python .ci/review/guard12/gpu_pool.py``.

A  static generates that drop their cache: results bitwise eager's; steady state replays with
   no capture and no rebase (the commit's claim).
B  memory: caches of K distinct lengths (one set-up, one pool each), all dead: the free memory
   the set-ups' pools keep, before and after torch.cuda.empty_cache(); reserved memory against
   the same run with the pool off (``SetUp._allocating`` -> (nullcontext, False)).
C  a generate on another stream, and one on another thread: bitwise eager's.

``DEV=sim`` runs A alone on the CPU double (a smoke run: no pool there, so its steady-state
line fails by design).
"""
import contextlib, copy, gc, os, sys, threading, time, warnings

sys.path.insert(0, os.getcwd())
warnings.simplefilter("ignore")
import torch, transformers
import cudagraphify as cg
from cudagraphify import _state

T0 = time.time()
DEV = "cuda"
SMOKE = os.environ.get("DEV") == "sim"  # (a CPU smoke run of A on the double: no pool, no B/C)
if SMOKE:
    sys.path.insert(0, "tests")
    from conftest import SimBackend
    from cudagraphify import _capture
    _capture.set_backend(SimBackend())
    DEV = "cpu"
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                               max_position_embeddings=512)
base = transformers.LlamaForCausalLM(cfg).to(DEV).eval()
NEW = 8
greedy = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


def report(ok, what):
    print(("PASS " if ok else "FAIL ") + what, flush=True)


def gen(m, prompt, eager=False):
    kw = dict(greedy, cache_implementation="static")
    if eager:
        kw["disable_compile"] = True
    with torch.no_grad():
        return m.generate(prompt, **kw)


def pools_kept():
    """(reserved, allocated) bytes of every live SetUp's pool."""
    res = alloc = n = 0
    for obj in gc.get_objects():
        if type(obj) is _state.SetUp and obj.pool is not None:
            n += 1
            try:
                segs = torch.cuda.memory_snapshot(obj.pool.id)
            except TypeError:
                segs = obj.pool.snapshot()
            segs = segs["segments"] if isinstance(segs, dict) else segs
            for s in segs:
                res += s["total_size"]
                alloc += s["allocated_size"]
    return n, res, alloc


# -- A ------------------------------------------------------------------------------------------
try:
    g = cg.graphify(copy.deepcopy(base))
    prompt = torch.randint(1, cfg.vocab_size, (1, 8), device=DEV)
    ok, counts = True, []
    for i in range(5):
        want = gen(base, prompt, eager=True)
        b = cg.stats(g)
        got = gen(g, prompt)
        a = cg.stats(g)
        ok &= torch.equal(got, want)
        counts.append((a.captures - b.captures, a.retargets - b.retargets, a.replays - b.replays,
                       a.set_ups - b.set_ups))
        gc.collect()
    report(ok, f"A static generates bitwise eager's ({counts})")
    report(all(c[:2] == (0, 0) and c[3] == 1 for c in counts[2:]),
           "A steady state: no capture, no rebase, one set-up per generate")
    del g
except Exception as e:  # noqa: BLE001
    report(False, f"A raised {type(e).__name__}: {e}")
if SMOKE:
    sys.exit(0)
gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()


# -- B ------------------------------------------------------------------------------------------
def run_lengths(pooled):
    saved = _state.SetUp._allocating
    if not pooled:
        _state.SetUp._allocating = lambda self: (contextlib.nullcontext(), False)
    try:
        g = cg.graphify(copy.deepcopy(base))
        gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
        r0 = torch.cuda.memory_reserved()
        cache_bytes = []
        ok = True
        for length in (8, 16, 24, 32):  # (distinct max_cache_len: a set-up each)
            p = torch.randint(1, cfg.vocab_size, (4, length), device=DEV)
            for _ in range(3):
                ok &= torch.equal(gen(g, p), gen(base, p, eager=True))
                gc.collect()
            kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
            cache_bytes.append(2 * cfg.num_hidden_layers * 4 * (length + NEW) * kv * 4)
        torch.cuda.synchronize()
        before_empty = pools_kept()
        r1 = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        after_empty = pools_kept()
        r2 = torch.cuda.memory_reserved()
        s = cg.stats(g)
        out = dict(ok=ok, r_before=r1 - r0, r_after=r2 - r0, pools_before=before_empty,
                   pools_after=after_empty, caches=sum(cache_bytes), graphs=s.graphs,
                   captures=s.captures)
        del g
        gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
        out["r_model_dropped"] = torch.cuda.memory_reserved() - r0
        return out
    finally:
        _state.SetUp._allocating = saved


try:
    off = run_lengths(False)
    on = run_lengths(True)
    for name, r in (("off", off), ("on", on)):
        print(f"INFO B pool {name}: reserved +{r['r_before'] >> 10} KiB, after empty_cache "
              f"+{r['r_after'] >> 10} KiB, model dropped +{r['r_model_dropped'] >> 10} KiB; "
              f"set-up pools (n, reserved, allocated) before empty_cache {r['pools_before']}, "
              f"after {r['pools_after']}; 4 caches {r['caches'] >> 10} KiB; graphs "
              f"{r['graphs']} captures {r['captures']}", flush=True)
    report(off["ok"] and on["ok"], "B generates bitwise eager's (pool off and on)")
    n, res, alloc = on["pools_after"]
    report(res - alloc == 0, f"B empty_cache gives back the free memory of dead caches in the "
           f"set-ups' pools (kept: {(res - alloc) >> 10} KiB over {n} pools)")
    report(on["r_after"] <= off["r_after"] + max(on["caches"] // 4, 1 << 20),
           "B reserved after empty_cache with the pool on within one cache of the pool off")
    report(on["r_model_dropped"] <= off["r_model_dropped"] + (1 << 20),
           "B dropping the model gives the pools' memory back")
except Exception as e:  # noqa: BLE001
    report(False, f"B raised {type(e).__name__}: {e}")
gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()

# -- C ------------------------------------------------------------------------------------------
try:
    g = cg.graphify(copy.deepcopy(base))
    p = torch.randint(1, cfg.vocab_size, (1, 8), device=DEV)
    for _ in range(3):
        assert torch.equal(gen(g, p), gen(base, p, eager=True))
        gc.collect()
    b = cg.stats(g)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        got, want = gen(g, p), gen(base, p, eager=True)
    torch.cuda.synchronize()
    a = cg.stats(g)
    report(torch.equal(got, want), f"C a generate on another stream bitwise eager's "
           f"(captures +{a.captures - b.captures}, replays +{a.replays - b.replays})")
    gc.collect()
    res = {}

    def worker():
        res["got"] = gen(g, p)
    th = threading.Thread(target=worker)
    th.start(); th.join()
    report(torch.equal(res.get("got", torch.empty(0)), gen(base, p, eager=True)),
           "C a generate on another thread bitwise eager's")
    # back on the default stream: the pool's blocks of the other stream's caches
    got = gen(g, p)
    report(torch.equal(got, gen(base, p, eager=True)), "C then on the default stream again")
except Exception as e:  # noqa: BLE001
    report(False, f"C raised {type(e).__name__}: {e}")
print(f"INFO done in {time.time() - T0:.1f} s (torch {torch.__version__}, "
      f"transformers {transformers.__version__})")
