"""Suspicion (d21c591): thrash marks are keyed by signature, and a static cache's signature
holds its tensors' addresses. generate(cache_implementation="static", return_dict_in_generate=
True) returns the cache in its output: a script that keeps a round of outputs (more than
max_graphs=16) has its oldest caches' decode graphs evicted while they live (evictions of keys
no later call will need). Once a round's outputs are dropped, the next round's caches are
allocated where those were (the caching allocator reuses the freed blocks): same keys, so the
marks add up, and from the third round a cache at such an address decodes eagerly for its
whole generate ("evicted 2 times") where before it was rebased and replayed. On the CPU double
addresses are not reused this way (and nothing is rebased): there it is INFO only. Tokens and
logits compared with eager's. See common.py."""
import copy
import time

import torch
import transformers

import cudagraphify as cg
from common import CPU, DEV, FAILS, check, info, rule_off, sync

transformers.logging.set_verbosity_error()
DTYPE = torch.float32 if CPU else torch.bfloat16
KEEP, ROUNDS = (17, 3) if CPU else (18, 4)  # (the CPU double: a smoke test, shorter)
GEN = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
           output_logits=True, return_dict_in_generate=True)
THRASH = "evicted 2 times before"

if CPU:
    from transformers import cache_utils
    from test_review_hfcache import DevStaticLayer
    cache_utils.STATIC_LAYER_TYPE_MAPPING["full_attention"] = DevStaticLayer


def model():
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      pad_token_id=0)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(config).to(DEV, DTYPE).eval()
    m.generation_config.pad_token_id = 0
    return m


def same(a, b):
    return torch.equal(a.sequences, b.sequences) and all(
        torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def scenario(ref, label):
    g = cg.graphify(copy.deepcopy(ref))
    bad, rounds = 0, []
    prompt = torch.randint(1, 256, (1, 5), device=DEV)
    want = ref.generate(prompt, cache_implementation="static", disable_compile=True, **GEN)
    t0 = time.perf_counter()
    for r in range(ROUNDS):
        s0 = cg.stats(g)
        kept = []
        for k in range(KEEP):
            out = g.generate(prompt, cache_implementation="static", **GEN)
            bad += not same(out, want)
            kept.append(out)
        s = cg.stats(g)
        thrash = sum(v for k, v in s.eager_calls.items() if THRASH in k) - \
            sum(v for k, v in s0.eager_calls.items() if THRASH in k)
        rounds.append((s.captures + s.retargets - s0.captures - s0.retargets,
                       s.replays - s0.replays, thrash))
        del kept, out
    sync()
    info(f"{label}: per round (captures+rebases, replays, thrash-eager calls) {rounds}; "
         f"bad {bad}; {time.perf_counter() - t0:.1f} s")
    return bad, rounds


def main():
    info(f"device {DEV} ({torch.cuda.get_device_name() if DEV.startswith('cuda') else 'CPU double'})")
    ref = model()
    with torch.no_grad():
        bad, rounds = scenario(ref, "rule on")
        with rule_off():
            bad0, rounds0 = scenario(ref, "rule off")
    check(bad == 0 and bad0 == 0, "[control] every generate: tokens and logits bitwise as "
          "eager's", f"bad={bad}/{bad0}")
    late = sum(t for _, _, t in rounds[2:])
    line = (f"[suspicion] rounds of {KEEP} kept generate() outputs: no decode call of rounds 3-4 "
            "runs eagerly for a thrash mark left at its cache's address")
    if CPU:
        info(f"{line}: thrash-eager calls {late} (CPU double: not expected here)")
    else:
        check(late == 0, line, f"thrash-eager calls {late}; rule off rounds {rounds0}")
    info(f"c_reuse done: {len(FAILS)} FAIL line(s)")


if __name__ == "__main__":
    main()
