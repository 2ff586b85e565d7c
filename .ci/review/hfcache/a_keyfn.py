"""Findings: a key_fn (or CachePolicy.key) that ignores the non-tensor arguments drops the
static cache's key (its tensors' addresses): another cache's graph replays (it writes the
memory that graph was captured on, freed when that cache's tensors were replaced), and with a
lazily set-up cache the engine recurses (_engine._call after _set_up). Expected: FAIL lines."""
from common import (DEV, DTYPE, Diff, GEN, check, decode, early, guarded, ids, pair, static,
                    stats)
import torch

MERGE = dict(key_fn=lambda sig: None)  # "only the shapes matter"


def two_live_caches():
    ref, g, config = pair(**MERGE)
    diff = Diff()
    ra, a = early(static(config), config), early(static(config), config)
    decode(ref, g, ra, a, ids(1, 8, 1), 5, diff, "cache A")
    before = [(layer.keys.clone(), layer.values.clone()) for layer in a.layers]
    rb, b = early(static(config), config), early(static(config), config)
    decode(ref, g, rb, b, ids(1, 8, 2), 5, diff, "cache B")
    untouched = all(torch.equal(k, layer.keys) and torch.equal(v, layer.values)
                    for (k, v), layer in zip(before, a.layers))
    check(diff.ok and untouched, "key_fn ignoring constants: two live StaticCaches",
          f"{diff.first or 'equal'}; cache A written by B's calls: {not untouched}; {stats(g)}")


def freed_memory():
    ref, g, config = pair(**MERGE)
    diff = Diff()
    rc, c = early(static(config), config), early(static(config), config)
    x = decode(ref, g, rc, c, ids(1, 8, 3), 4, diff, "before")
    old = {layer.keys.data_ptr() for layer in c.layers} | \
        {layer.values.data_ptr() for layer in c.layers}
    shapes = [layer.keys.shape for layer in c.layers] * 4  # (the twin's are freed too)
    for cc in (rc, c):  # new memory, same contents (as .to(), .clone(), reorder_cache)
        fresh = [(layer.keys.clone(), layer.values.clone()) for layer in cc.layers]
        for layer, (k, v) in zip(cc.layers, fresh):
            layer.keys, layer.values = k, v
        del fresh
    if DEV == "cuda":
        torch.cuda.synchronize()
    # the freed blocks, handed to other tensors (same sizes, same stream)
    victims = [torch.full(s, 7.0, dtype=DTYPE, device=DEV) for s in shapes]
    landed = sum(v.data_ptr() in old for v in victims)
    decode(ref, g, rc, c, x, 3, diff, "after the replacement")
    spoiled = sum(not bool((v == 7).all()) for v in victims)
    check(diff.ok and spoiled == 0, "key_fn ignoring constants: a cache whose tensors moved",
          f"{diff.first or 'equal'}; {landed} of {len(victims)} new tensors on the freed memory, "
          f"{spoiled} of them overwritten by a replay; {stats(g)}")


def recursion():
    ref, g, _ = pair(**MERGE)
    diff = Diff()
    for n in range(2):
        prompt = ids(1, 8, 10 + n)
        want = ref.generate(prompt, cache_implementation="static", disable_compile=True, **GEN)
        try:
            got = g.generate(prompt, cache_implementation="static", **GEN)
        except RecursionError:
            check(False, "key_fn ignoring constants: generate(cache_implementation='static')",
                  f"generate {n}: RecursionError in cudagraphify (_engine._call after "
                  f"_set_up); {stats(g)}")
            return
        diff.tokens(got.sequences, want.sequences, f"generate {n}")
    check(diff.ok, "key_fn ignoring constants: generate(cache_implementation='static')",
          f"{diff.first or 'equal'}; {stats(g)}")


guarded("key_fn ignoring constants: two live StaticCaches", two_live_caches)
guarded("key_fn ignoring constants: a cache whose tensors moved", freed_memory)
guarded("key_fn ignoring constants: generate(cache_implementation='static')", recursion)
