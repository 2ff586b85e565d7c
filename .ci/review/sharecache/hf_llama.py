"""HF Llama (tiny, bf16) with StaticCache, share_graph(model.model.layers), vs an eager copy."""
import sys
import torch
from common import llama, static_cache, generate, report, cache_diffs

which = sys.argv[1] if len(sys.argv) > 1 else "all"

if which in ("all", "decode"):
    cfg, ref, model, group = llama(4)
    bad = generate(ref, model, static_cache(cfg, 16), static_cache(cfg, 16), steps=8)
    report("hf_llama_decode_8_steps", bad, group)

if which in ("all", "reset"):
    # one cache per model, reset between generations (what generate() does with a static cache)
    cfg, ref, model, group = llama(4, seed=1)
    rc, c = static_cache(cfg, 16), static_cache(cfg, 16)
    bad = []
    for gen in range(3):
        bad += generate(ref, model, rc, c, steps=4, seed=gen, tag=f"gen{gen}")
        rc.reset()
        c.reset()
    report("hf_llama_reset_between_generations", bad, group)

if which in ("all", "interleave"):
    # two conversations decoded alternately, step by step (two caches: two keys, two templates)
    cfg, ref, model, group = llama(4, seed=2)
    caches = [(static_cache(cfg, 16), static_cache(cfg, 16)) for _ in range(2)]
    bad = []
    with torch.no_grad():
        toks = []
        for j, (rc, c) in enumerate(caches):
            ids = torch.randint(0, 1000, (1, 5), device="cuda")
            pos = torch.arange(5, device="cuda")
            w = ref(input_ids=ids, past_key_values=rc, cache_position=pos).logits
            g = model(input_ids=ids, past_key_values=c, cache_position=pos).logits
            bad += [] if torch.equal(w, g) else [("prefill", j)]
            toks.append(w[:, -1:].argmax(-1))
        for s in range(5):
            for j, (rc, c) in enumerate(caches):
                pos = torch.tensor([5 + s], device="cuda")
                w = ref(input_ids=toks[j], past_key_values=rc, cache_position=pos).logits
                g = model(input_ids=toks[j], past_key_values=c, cache_position=pos).logits
                bad += [] if torch.equal(w, g) else [("logits", j, s)]
                bad += cache_diffs(rc, c, (j, s))
                toks[j] = w[:, -1:].argmax(-1)
    report("hf_llama_two_caches_interleaved", bad, group)

if which in ("all", "fresh"):
    # a new StaticCache per generation, the last one dropped (new addresses each time): stays
    # right; sharing should not stop after max_graphs caches (a template whose cache is gone
    # no longer counts; with max_graphs caches alive at once, the next one is refused by design)
    cfg, ref, model, group = llama(2, seed=3)
    bad = []
    for gen in range(18):
        rc, c = static_cache(cfg, 8 + gen), static_cache(cfg, 8 + gen)
        bad += generate(ref, model, rc, c, prompt=4, steps=2, seed=gen, tag=f"g{gen}")
        del rc, c
    s = group.stats()
    stopped = [r for r in s.reasons if "max_graphs" in r]
    report("hf_llama_fresh_cache_each_generation_correct", bad, group)
    report("hf_llama_fresh_cache_each_generation_keeps_sharing",
           [("sharing stopped", stopped)] if stopped else [], None)
    print(f"INFO template_pool_bytes={s.template_pool_bytes}")

if which in ("all", "unshare"):
    cfg, ref, model, group = llama(4, seed=4)
    rc, c = static_cache(cfg, 16), static_cache(cfg, 16)
    bad = generate(ref, model, rc, c, steps=3, seed=5, tag="before")
    group.unshare()
    with torch.no_grad():
        for s in range(3):
            tok = torch.tensor([[7 + s]], device="cuda")
            pos = torch.tensor([9 + s], device="cuda")
            w = ref(input_ids=tok, past_key_values=rc, cache_position=pos).logits
            g = model(input_ids=tok, past_key_values=c, cache_position=pos).logits
            if not torch.equal(w, g):
                bad.append(("after unshare", s))
            bad += cache_diffs(rc, c, ("after unshare", s))
    report("hf_llama_unshare_midway", bad)
