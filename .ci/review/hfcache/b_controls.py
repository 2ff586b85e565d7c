"""Controls: a user's ways with HF caches under graphify(model), default options. Expected:
PASS lines (a FAIL is a silent wrong result, or an error eager does not raise)."""
import torch

from transformers import DynamicCache

from common import (DEV, DTYPE, GEN, Diff, check, decode, early, generate, guarded, ids, pair,
                    static, stats)


def reset_kept_cache():
    ref, g, config = pair()
    rc, c, diff = static(config), static(config), Diff()
    for n, length in enumerate((8, 5, 8, 8)):
        rc.reset()
        c.reset()
        want = ref.generate(ids(1, length, n), past_key_values=rc, disable_compile=True,
                            **GEN)
        got = g.generate(ids(1, length, n), past_key_values=c, **GEN)
        diff.tokens(got.sequences, want.sequences, f"generate {n}")
        for t, (a, b) in enumerate(zip(got.logits, want.logits)):
            diff.logits(a, b, f"generate {n} token {t}")
        diff.cache(rc, c, f"generate {n}")
    check(diff.ok, "a kept StaticCache reset between generates (prompts 8, 5, 8, 8)",
          f"{diff.first or 'equal'}; {stats(g)}")


def generate_static_varied():
    ref, g, _ = pair()
    diff = Diff()
    for n, (batch, length, pad) in enumerate([(1, 8, 0), (1, 8, 0), (1, 5, 0), (2, 8, 3),
                                              (1, 8, 0), (2, 8, 0), (1, 8, 0)]):
        prompt = ids(batch, length, 20 + n)
        mask = torch.ones_like(prompt)
        mask[0, :pad] = 0
        prompt[0, :pad] = 0
        generate(ref, g, prompt, diff, f"generate {n}", attention_mask=mask,
                 cache_implementation="static")
    check(diff.ok, "generate(cache_implementation='static'): prompts, lengths, batch, padding",
          f"{diff.first or 'equal'}; {stats(g)}")


def live_caches_interleaved():
    ref, g, config = pair()
    diff = Diff()
    pairs = [(static(config), static(config)) for _ in range(3)]
    xs = [ids(1, 8, 30 + k) for k in range(3)]
    for t in range(8):
        for k, (rc, c) in enumerate(pairs):
            if t == 4 and k == 1:
                rc.reset()
                c.reset()
                xs[k] = ids(1, 8, 40)
            xs[k] = decode(ref, g, rc, c, xs[k], 1, diff, f"cache {k} step {t}")
    check(diff.ok, "three live StaticCaches, interleaved steps, one reset mid-way",
          f"{diff.first or 'equal'}; {stats(g)}")


def replaced_then_new_cache_on_old_memory():
    """A's tensors replaced (A alive: its graphs stay, keyed to the freed addresses); a new
    cache B then lies (likely) on that memory and matches those graphs' keys."""
    ref, g, config = pair()
    diff = Diff()
    ra, a = early(static(config), config), early(static(config), config)
    xa = decode(ref, g, ra, a, ids(1, 8, 50), 4, diff, "A")
    old = {layer.keys.data_ptr() for layer in a.layers}
    for cc in (ra, a):
        fresh = [(layer.keys.clone(), layer.values.clone()) for layer in cc.layers]
        for layer, (k, v) in zip(cc.layers, fresh):
            layer.keys, layer.values = k, v
        del fresh
    rb, b = early(static(config), config), early(static(config), config)
    landed = sum(layer.keys.data_ptr() in old for layer in b.layers)
    xb = decode(ref, g, rb, b, ids(1, 8, 51), 3, diff, "B")
    for t in range(3):
        xa = decode(ref, g, ra, a, xa, 1, diff, f"A again {t}")
        xb = decode(ref, g, rb, b, xb, 1, diff, f"B again {t}")
    check(diff.ok, "a cache's tensors replaced, a new cache on the freed memory",
          f"{diff.first or 'equal'}; {landed} of B's key tensors on A's old memory; {stats(g)}")


def beam_search_static():
    ref, g, _ = pair()
    diff = Diff()
    for n in range(2):
        generate(ref, g, ids(1, 8, 60 + n), diff, f"beams {n}", num_beams=3,
                 cache_implementation="static")
    check(diff.ok, "beam search with a static cache (reorder_cache: new memory every step)",
          f"{diff.first or 'equal'}; {stats(g)}")


def reorder_kept_cache():
    ref, g, config = pair()
    diff = Diff()
    rc, c = early(static(config), config, 2), early(static(config), config, 2)
    x = decode(ref, g, rc, c, ids(2, 8, 70), 2, diff, "prefill")
    for t in range(8):
        idx = torch.tensor([1, 0] if t % 2 else [0, 0], device=DEV)
        rc.reorder_cache(idx)
        c.reorder_cache(idx)
        x = decode(ref, g, rc, c, x, 1, diff, f"reorder {t}")
    check(diff.ok, "reorder_cache on a kept StaticCache every step (addresses ping-pong)",
          f"{diff.first or 'equal'}; {stats(g)}")


def two_models_positional():
    ref1, g1, config = pair(0)
    ref2, g2, _ = pair(1)
    diff = Diff()
    rc, c = static(config), static(config)
    x = ids(1, 8, 80)
    for t in range(5):
        for ref, g in ((ref1, g1), (ref2, g2)):
            want = ref(x, past_key_values=rc, use_cache=True).logits
            got = g(x, past_key_values=c, use_cache=True).logits
            diff.logits(got, want, f"step {t}")
            diff.cache(rc, c, f"step {t}")
        x = want[:, -1:].argmax(-1)
    for t in range(3):  # (input_ids, attention_mask, position_ids, past_key_values, ...)
        want = ref1(x, None, None, rc, None, None, True).logits
        got = g1(x, None, None, c, None, None, True).logits
        diff.logits(got, want, f"positional {t}")
        x = want[:, -1:].argmax(-1)
    check(diff.ok, "one StaticCache, two graphed models; positional past_key_values",
          f"{diff.first or 'equal'}; {stats(g1)} | {stats(g2)}")


def static_dynamic_crop():
    ref, g, config = pair()
    diff = Diff()
    for n, kind in enumerate("sds"):
        if kind == "s":
            rc, c = static(config), static(config)
        else:
            rc, c = DynamicCache(config=config), DynamicCache(config=config)
        decode(ref, g, rc, c, ids(1, 8, 90 + n), 4, diff, f"{kind}{n}")
        if kind == "d":
            rc.crop(-3)
            c.crop(-3)
            decode(ref, g, rc, c, ids(1, 3, 95 + n), 3, diff, f"crop{n}")
    check(diff.ok, "StaticCache and DynamicCache (cropped) on one model",
          f"{diff.first or 'equal'}; {stats(g)}")


def model_dtype_changes():
    """generate(cache_implementation='static') in the model's dtype, then after .to(another
    dtype) (the caches follow: set-ups recorded before must not apply), then back."""
    ref, g, _ = pair()
    other = torch.float32 if DTYPE == torch.bfloat16 else torch.float64
    diff = Diff()
    for n, dtype in enumerate([DTYPE, DTYPE, other, other, DTYPE, DTYPE]):
        ref.to(dtype)
        g.to(dtype)
        generate(ref, g, ids(1, 8, 100 + n), diff, f"{dtype} {n}", cache_implementation="static")
    check(diff.ok, "generate static, the model moved to another dtype and back",
          f"{diff.first or 'equal'}; {stats(g)}")


for name, fn in [("reset kept cache", reset_kept_cache),
                 ("generate static varied", generate_static_varied),
                 ("live caches interleaved", live_caches_interleaved),
                 ("replaced then new cache", replaced_then_new_cache_on_old_memory),
                 ("beam search static", beam_search_static),
                 ("reorder kept cache", reorder_kept_cache),
                 ("two models, positional", two_models_positional),
                 ("static/dynamic/crop", static_dynamic_crop),
                 ("model dtype changes", model_dtype_changes)]:
    guarded(name, fn)
