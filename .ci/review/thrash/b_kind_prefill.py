"""99043f9: once a callable demoted two static caches of one kind, a new cache of that kind is
demoted before its first call. HF Qwen2 with a sliding-window layer and generate(
cache_implementation="static") with a new prompt length per request: the prefill of a cache
demoted at once runs eagerly around it with the plan's pieces, which capture the prompt's
shape (never replayed); before, that prefill was the cache's set-up call, eager. Each piece's
eviction budget (max_evictions=64) is then spent on those captures, after which a new
signature (a batch of two) is never graphed. Tokens and logits bitwise against eager's on the
generates compared. See common.py."""
import copy
import statistics
import time

import torch
import transformers

import cudagraphify as cg
from common import CPU, DEV, FAILS, check, info, rule_off, sync

transformers.logging.set_verbosity_error()
DTYPE = torch.float32 if CPU else torch.bfloat16
NEW = 8
LENGTHS = 84  # > max_graphs (16) + max_evictions (64) prompt lengths: every piece's budget spent
BUDGET_S = 9.0  # wall time for each rule's prompt-length loop (stops early, says so)
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
           output_logits=True, return_dict_in_generate=True)

if CPU:  # HF's full-attention layer with its counter in "device" memory (tests/test_review_hfcache)
    from transformers import cache_utils
    from test_review_hfcache import DevStaticLayer
    cache_utils.STATIC_LAYER_TYPE_MAPPING["full_attention"] = DevStaticLayer


def model():
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      use_sliding_window=True, sliding_window=6,
                                      max_window_layers=1, pad_token_id=0)
    torch.manual_seed(0)
    m = transformers.Qwen2ForCausalLM(config).to(DEV, DTYPE).eval()
    m.generation_config.pad_token_id = 0
    return m


def all_counts(g):
    states = [s for s in (m.__dict__.get("_cudagraphify_state") for m in g.modules()) if s]
    return (sum(s.captures for s in states), sum(s.replays for s in states),
            sum(sum(s.eager_calls.values()) for s in states))


def same(a, b):
    """Tokens and logits bitwise equal. (CPU double, a batch of two: CPU BLAS rounds a
    (2, k) x (k, n) product differently with the input's address alignment, eager against eager
    too: there the logits only to 1e-5. A GPU compares bitwise.)"""
    if not torch.equal(a.sequences, b.sequences) or len(a.logits) != len(b.logits):
        return False
    if CPU and a.sequences.shape[0] > 1:
        return all(torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(a.logits, b.logits))
    return all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def scenario(ref, label):
    g = cg.graphify(copy.deepcopy(ref))
    per, times, bad, compared = [], [], 0, 0
    start = time.perf_counter()
    n = 0
    for n in range(LENGTHS):
        if time.perf_counter() - start > BUDGET_S:
            break
        ids = torch.randint(1, 256, (1, 2 + n), device=DEV)
        before = all_counts(g)
        sync()
        t = time.perf_counter()
        got = g.generate(ids, cache_implementation="static", **GEN)
        sync()
        times.append(time.perf_counter() - t)
        per.append(all_counts(g)[0] - before[0])
        if n < 6 or n % 8 == 0:
            want = ref.generate(ids, cache_implementation="static", disable_compile=True, **GEN)
            compared += 1
            bad += not same(got, want)
    else:
        n = LENGTHS
    before = all_counts(g)
    for k in range(4):
        ids = torch.randint(1, 256, (2, 5), device=DEV)
        got = g.generate(ids, cache_implementation="static", **GEN)
        want = ref.generate(ids, cache_implementation="static", disable_compile=True, **GEN)
        compared += 1
        bad += not same(got, want)
    batch2 = tuple(a - b for a, b in zip(all_counts(g), before))
    later = times[6:] or times
    info(f"{label}: {n} prompt lengths in {time.perf_counter() - start:.1f} s; captures per "
         f"generate {per}; median generate {statistics.median(later) * 1e3:.1f} ms from the "
         f"seventh; batch 2 (captures, replays, eager) {batch2}; compared {compared}, bad {bad}")
    return n, per, batch2, bad, statistics.median(later)


def main():
    info(f"device {DEV} ({torch.cuda.get_device_name() if DEV.startswith('cuda') else 'CPU double'})")
    ref = model()
    with torch.no_grad():
        n, per, batch2, bad, med = scenario(ref, "rule on")
        with rule_off():
            n0, per0, batch20, bad0, med0 = scenario(ref, "rule off")
    check(bad == 0 and bad0 == 0, "[control] every generate compared: tokens and logits bitwise "
          "as eager's (rule on and off)", f"bad={bad}/{bad0}")
    check(sum(per[4:12]) < 18, "[finding] generates 5-12 (new prompt lengths) capture no more "
          "than a generate's worth of piece graphs",
          f"captures {per[4:12]} (rule off: {per0[4:12]})")
    info(f"median generate: rule on {med * 1e3:.1f} ms, rule off {med0 * 1e3:.1f} ms")
    if n >= LENGTHS:
        check(batch2[1] > 0, f"[finding] after {LENGTHS} prompt lengths a batch of two still "
              "graphs in the pieces (their eviction budget not spent by prefills)",
              f"(captures, replays, eager) {batch2}; rule off {batch20}")
    else:
        info(f"only {n} of {LENGTHS} prompt lengths in {BUDGET_S} s: the batch-2 check needs "
             f"all (batch 2: {batch2}; rule off {batch20})")
    sync()
    info(f"b_kind_prefill done: {len(FAILS)} FAIL line(s)")


if __name__ == "__main__":
    main()
