"""GPU checks for 586773d (function pieces: HF's apply_rotary_pos_emb graphed as a piece of
a piecewise root, cudagraphify/_funcpieces.py).

HF Llama, small configs, bf16 on cuda, DynamicCache generate() (a plan around the opaque
cache). Each case compares tokens and logits with an eager twin (torch.equal) and prints one
PASS/FAIL line with the rotary function's replays (so a PASS is known to have graphed it).
Run: PYTHONPATH=. python .ci/review/funcpieces/gpu_funcpieces.py   (~30 s on an H100)
"""
from __future__ import annotations

import copy
import threading
import traceback
import warnings

import torch
import transformers
from transformers.models.llama import modeling_llama

import cudagraphify as cg
from cudagraphify import _funcpieces

warnings.simplefilter("ignore")
dev = torch.device("cuda")
NEW = 12
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
           output_logits=True, return_dict_in_generate=True)
RESULTS = []


def model(**kw):
    base = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                pad_token_id=0)
    base.update(kw)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base))
    m = m.to(dev, torch.bfloat16).eval()
    m.generation_config.pad_token_id = 0
    return m


def rotary_replays():
    fn = modeling_llama.apply_rotary_pos_emb
    return cg.stats(fn).replays if _funcpieces.states_of(fn) is not None else 0


def same(a, b):
    if not torch.equal(a.sequences, b.sequences):
        return "tokens differ"
    if len(a.logits) != len(b.logits) or not all(
            torch.equal(x, y) for x, y in zip(a.logits, b.logits)):
        return "logits differ"
    return None


def case(fn):
    def run():
        before = rotary_replays()
        try:
            msg = fn()
            ok, why = (True, "") if msg is None else (False, msg)
        except Exception as e:  # noqa: BLE001
            ok, why = False, "raised " + "".join(traceback.format_exception_only(e)).strip()
        torch.cuda.synchronize()
        RESULTS.append(ok)
        print(f"{'PASS' if ok else 'FAIL'} {fn.__name__} (rotary replays: "
              f"{rotary_replays() - before})" + (f": {why}" if why else ""), flush=True)
    return run


@case
def generate_two_lengths_and_padded_batch():
    ref = model()
    g = cg.graphify(copy.deepcopy(ref))
    torch.manual_seed(1)
    with torch.no_grad():
        for n in range(5):
            ids = torch.randint(1, 256, (2, 8 if n % 2 else 5), device=dev)
            mask = torch.ones_like(ids)
            mask[0, :2] = 0
            want = ref.generate(ids, attention_mask=mask, **GEN)
            got = g.generate(ids, attention_mask=mask, **GEN)
            why = same(got, want)
            if why:
                return f"generate {n}: {why}"
    return None


@case
def two_configs_and_eager_twin_interleaved():
    pairs = []
    for kw in ({}, dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)):
        ref = model(**kw)
        pairs.append((ref, cg.graphify(copy.deepcopy(ref))))
    torch.manual_seed(2)
    with torch.no_grad():
        for n in range(4):
            for j, (ref, g) in enumerate(pairs):
                ids = torch.randint(1, 256, (1, 6), device=dev)
                want = ref.generate(ids, **GEN)
                why = same(g.generate(ids, **GEN), want)
                if why:
                    return f"model {j} generate {n}: {why}"
    return None


@case
def threads_from_the_first_call():
    """FP-1 on the GPU: one graphified model, four threads generating from its first call."""
    ref = model()
    g = cg.graphify(copy.deepcopy(ref))
    torch.manual_seed(3)
    prompts = [torch.randint(1, 256, (1, 6), device=dev) for _ in range(4)]
    with torch.no_grad():
        wants = [ref.generate(p, **GEN) for p in prompts]
    bad = []

    def work(k):
        with torch.no_grad():
            for r in range(3):
                try:
                    why = same(g.generate(prompts[k], **GEN), wants[k])
                except Exception as e:  # noqa: BLE001 - a thread's error is a FAIL too
                    why = f"raised {type(e).__name__}: {e}"
                if why:
                    bad.append(f"thread {k} round {r}: {why}")
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return "; ".join(bad[:3]) or None


for run in (generate_two_lengths_and_padded_batch, two_configs_and_eager_twin_interleaved,
            threads_from_the_first_call):
    run()
print(f"{sum(RESULTS)}/{len(RESULTS)} PASS")
