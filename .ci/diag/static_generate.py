"""GPU diagnosis (#18): where a graphified ``generate(cache_implementation="static")`` spends
what a StaticCache kept across calls does not. Llama 8 layers, hidden 512, bf16, 64 new tokens,
greedy, as the bench's decode rows. Each generate timed alone (eager, kept, static, in turn),
the stats' deltas per generate, then one kept and one static generate under cProfile (the
functions with the most own time, and cudagraphify's by cumulative time)."""
import copy, cProfile, io, pstats, statistics, time, warnings
import torch, transformers
import os
import cudagraphify as cg

DEV = os.environ.get("DEV", "cuda")  # (cpu: a smoke run, no graph; sim: the CPU double)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
if DEV == "sim":  # the CPU double (tests/conftest.py): host time only, no rebased graphs
    import sys
    sys.path.insert(0, "tests")
    from conftest import SimBackend
    from cudagraphify import _capture
    _capture.set_backend(SimBackend())
    DEV = "cpu"

warnings.simplefilter("ignore")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                               max_position_embeddings=256)
base = transformers.LlamaForCausalLM(cfg).to(DEV, torch.bfloat16 if DEV == "cuda" else torch.float32).eval()
prompt = torch.randint(0, cfg.vocab_size, (1, 32), device=DEV)
greedy = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
models = {"eager": base, "kept": cg.graphify(copy.deepcopy(base)),
          "static": cg.graphify(copy.deepcopy(base))}
kept_cache = transformers.StaticCache(config=cfg, max_cache_len=96)


def kwargs(name):
    if name == "eager":
        return dict(greedy, disable_compile=True, cache_implementation="static")
    if name == "kept":
        kept_cache.reset()
        return dict(greedy, past_key_values=kept_cache)
    return dict(greedy, cache_implementation="static")


def one(name):
    m = models[name]
    kw = kwargs(name)
    before = cg.stats(m) if name != "eager" else None
    sync()
    t0 = time.perf_counter()
    out = m.generate(prompt, **kw)
    sync()
    s = time.perf_counter() - t0
    delta = ""
    if before is not None:
        a = cg.stats(m)
        delta = (f"captures +{a.captures - before.captures} replays +{a.replays - before.replays}"
                 f" rebased +{a.retargets - before.retargets} set_ups +{a.set_ups - before.set_ups}"
                 f" eager +{a.eager - before.eager if hasattr(a, 'eager') else '?'}"
                 f" build_s +{a.capture_seconds - before.capture_seconds:.4f}")
    return out, s, delta


times = {k: [] for k in models}
outs = {}
with torch.no_grad():
    for i in range(7):
        for name in models:
            out, s, delta = one(name)
            outs.setdefault(name, out)
            assert torch.equal(out, outs["eager"] if name != "eager" else out), name
            times[name].append(s)
            print(f"gen {i} {name:6s} {s * 1e3:8.1f} ms  {delta}", flush=True)
for name, ts in times.items():
    print(f"{name}: median of later {statistics.median(ts[1:]) * 1e3:.1f} ms, "
          f"{64 / statistics.median(ts[1:]):.0f} tokens/s")
e = statistics.median(times["eager"][1:])
for name in ("kept", "static"):
    print(f"{name} / eager speed-up {e / statistics.median(times[name][1:]):.2f}x")
print("static reasons:", dict(list(cg.stats(models["static"]).reasons.items())[:5]))
print("static eager_calls:", dict(list(cg.stats(models["static"]).eager_calls.items())[:5]))
for name in ("kept", "static"):
    pr = cProfile.Profile()
    kw = kwargs(name)
    sync()
    pr.enable()
    models[name].generate(prompt, **kw)
    sync()
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats("cudagraphify", 30)
    print(f"==== profile {name}\n" + "\n".join(
        line[:170] for line in buf.getvalue().splitlines() if line.strip()))
