"""GPU diagnosis (#16): HF ``generate()`` with its default DynamicCache, ``graphify(model)``
(pieces) against ``graphify(model, segments=True)``. The H100 bench had segments at 0.90x
eager and pieces at 1.27x. The CPU double (``--cpu``: host time only, its replay a no-op) shows
the same order on a small bf16 Llama (segments 2973 µs a token, pieces 1958, eager 3191).

Llama 8 layers, hidden 512, bf16, prompt 32, 64 new tokens, greedy (the bench's). Prints µs a
token (best of 3 generates after 3 settling ones) for eager, pieces and segments, tokens
against eager's, the segment plan's counters (segments, replays, divergences, misses, members
answered whole, calls matched, records) and its trial's verdict; then a cProfile of one
segments generate (top functions by own time) and the intercepted calls a token: how many
and what they cost."""
from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time
import warnings

import torch
import transformers

import cudagraphify as cg

p = argparse.ArgumentParser()
p.add_argument("--cpu", action="store_true")
p.add_argument("--tokens", type=int, default=64)
opts = p.parse_args()
warnings.simplefilter("ignore")
DEV = "cuda" if torch.cuda.is_available() and not opts.cpu else "cpu"
if DEV == "cpu":
    sys.path.insert(0, "tests")
    from conftest import SimBackend, SimGraph
    from cudagraphify import _capture
    SimGraph.replay = lambda self: None
    _capture.set_backend(SimBackend())
    torch.set_num_threads(1)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=1000)
else:
    sizes = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
N = opts.tokens
cfg = transformers.LlamaConfig(**sizes, max_position_embeddings=32 + N)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).to(DEV, torch.bfloat16).eval()
prompt = torch.randint(0, cfg.vocab_size, (1, 32), device=DEV)
greedy = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0,
              disable_compile=True)
variants = {"eager": model, "pieces": cg.graphify(copy.deepcopy(model)),
            "segments": cg.graphify(copy.deepcopy(model), segments=True)}


def best(m, rounds=3):
    times, out = [], None
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        out = m.generate(prompt, **greedy)
        sync()
        times.append(time.perf_counter() - t0)
    return min(times) / N * 1e6, out


with torch.no_grad():
    for m in variants.values():
        for _ in range(3):
            m.generate(prompt, **greedy)
    rows = {name: best(m) for name, m in variants.items()}
    ref = rows["eager"][1]
    e_us = rows["eager"][0]
    for name, (us, out) in rows.items():
        print(f"{name:9s} {us:8.0f} µs a token ({e_us / us:.2f}x eager's tokens/s); "
              f"tokens identical: {torch.equal(out, ref)}")
    seg = variants["segments"]
    state = seg._cudagraphify_state
    for plan in state.segments.plans():
        graphed = sum(1 for s in plan.segments if s.graph is not None)
        print(f"plan: {len(plan.calls)} calls, {graphed} of {len(plan.segments)} segments "
              f"graphed, replays {plan.replays}, divergences {plan.divergences}, misses "
              f"{plan.misses}, whole {plan.whole}, matched {plan.matched}")
        for line in plan.describe()[:3]:
            print("   ", line)
    print("records per key:", [item[2] for item in state.segments._plans.values()])
    print("stats:", cg.stats(seg))
    pr = cProfile.Profile()
    pr.enable()
    seg.generate(prompt, **greedy)
    sync()
    pr.disable()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(30)
    for key, row in st.stats.items():
        if key[2] == "__torch_function__" and key[0].endswith("_segmodes.py"):
            print(f"intercepted calls a token: {row[1] / N:.0f}, {row[3] / row[1] * 1e6:.2f} µs "
                  "each (cumulative, profiled)")
