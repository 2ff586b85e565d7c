"""GPU diagnosis (#18): share_graph over an HF Llama's layers (hidden 512, bf16), decoding with a
StaticCache, no options; 4 and 16 layers. Three copies side by side: eager, every layer
graphified on its own, share_graph. Logits and every cache tensor compared with eager bitwise
at every step; the group's counters and refusal reasons; ms per decode step (median of the
steps after the first, each timed alone, synchronised)."""
import copy
import statistics
import sys
import time
import warnings

import torch
import transformers

import cudagraphify as cg

warnings.simplefilter("ignore")


def step_ms(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def run(layers, steps=12, prompt=8):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376,
                                   num_hidden_layers=layers, num_attention_heads=8,
                                   num_key_value_heads=4, vocab_size=32000)
    ref = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    per = copy.deepcopy(ref)
    for layer in per.model.layers:
        cg.graphify(layer)
    shared = copy.deepcopy(ref)
    group = cg.share_graph(shared.model.layers)
    models = {"eager": ref, "per-layer": per, "share": shared}
    caches = {k: transformers.StaticCache(config=cfg, max_cache_len=prompt + steps + 1)
              for k in models}
    ids = torch.randint(0, 32000, (1, prompt), device="cuda")
    bad, ms = [], {k: [] for k in models}
    with torch.no_grad():
        logits = {k: m(input_ids=ids, past_key_values=caches[k]).logits
                  for k, m in models.items()}
        tok = logits["eager"][:, -1:].argmax(-1)
        for s in range(steps):
            pos = torch.tensor([prompt + s], device="cuda")
            for k, m in models.items():
                logits[k], t = step_ms(lambda: m(input_ids=tok, past_key_values=caches[k],
                                                 cache_position=pos).logits)
                ms[k].append(t)
            for k in ("per-layer", "share"):
                if not torch.equal(logits[k], logits["eager"]):
                    bad.append((k, "logits", s))
                for i, (a, b) in enumerate(zip(caches["eager"].layers, caches[k].layers)):
                    if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
                        bad.append((k, "cache", s, i))
            tok = logits["eager"][:, -1:].argmax(-1)
    st = group.stats()
    print(f"layers {layers}: captures {st.captures} retargets {st.retargets} "
          f"per_layer {st.per_layer} unproven {sum(st.unproven_slots.values())} "
          f"replays {[cg.stats(layer).replays for layer in shared.model.layers]}")
    print("  reasons", st.reasons)
    med = {k: statistics.median(v[1:]) for k, v in ms.items()}
    print("  first decode step ms: " + ", ".join(f"{k} {v[0]:.1f}" for k, v in ms.items()))
    print("  later steps, median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
          + f"; share / per-layer {med['share'] / med['per-layer']:.3f}, "
          f"share / eager {med['share'] / med['eager']:.3f}")
    print("  BAD" if bad else "  OK: logits and caches bitwise eager's", bad[:8])


for n in ([int(sys.argv[1])] if len(sys.argv) > 1 else [4, 16]):
    run(n)
