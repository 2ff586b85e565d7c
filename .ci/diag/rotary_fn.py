"""GPU diagnosis (#16, DynamicCache generate >= 1.5x): what graphing the attention's rotary
embedding function (``apply_rotary_pos_emb``, ~10 kernels a layer, eager under the pieces
plan) gives. HF Llama (8 layers, hidden 512, bf16) ``generate()`` with its default
DynamicCache, 64 tokens, one process, rounds in turn: eager; ``graphify(model)`` with the
function pieces it installs (cudagraphify/_funcpieces.py); another ``graphify(model)`` with the
original function bound during its calls (the pieces' plan alone, as before function pieces);
and (``--by-hand``) ``graphify`` of the function by the user, bound during its calls (how it was
first measured, before function pieces). Prints µs a token (median of 5 rounds), the decode
step alone, and tokens against eager's.

    source .device/install.sh && python3 .ci/diag/rotary_fn.py"""
import copy
import statistics
import sys
import time
import warnings

import torch
import transformers
from transformers.models.llama import modeling_llama

import cudagraphify as cg

warnings.simplefilter("ignore")
N = 64
cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                               max_position_embeddings=32 + N + 8)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
prompt = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
greedy = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0,
              disable_compile=True)
original = modeling_llama.apply_rotary_pos_emb
auto, plain = cg.graphify(copy.deepcopy(model)), cg.graphify(copy.deepcopy(model))
with torch.no_grad():  # (its plan installs the function pieces' wrapper)
    auto.generate(prompt, **greedy)
installed = modeling_llama.apply_rotary_pos_emb
print("function piece installed:", installed is not original)
forms = {"eager": (model, installed),
         "graphify": (auto, installed),
         "graphify, rotary eager": (plain, original)}
if "--by-hand" in sys.argv:
    forms["graphify+by hand"] = (cg.graphify(copy.deepcopy(model)), cg.graphify(original))


def gen(m, fn):
    modeling_llama.apply_rotary_pos_emb = fn
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = m.generate(prompt, **greedy)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / N * 1e6, out
    finally:
        modeling_llama.apply_rotary_pos_emb = installed


def steps(m, fn, n=32):
    modeling_llama.apply_rotary_pos_emb = fn
    try:
        o = m(input_ids=prompt, use_cache=True)
        c = o.past_key_values
        tok = o.logits[:, -1:].argmax(-1)
        for _ in range(3):
            m(input_ids=tok, past_key_values=c, use_cache=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            m(input_ids=tok, past_key_values=c, use_cache=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        modeling_llama.apply_rotary_pos_emb = installed


with torch.no_grad():
    for _ in range(4):
        for name, (m, fn) in forms.items():
            gen(m, fn)
    g_us = {k: [] for k in forms}
    s_us = {k: [] for k in forms}
    outs = {}
    for r in range(5):
        for name, (m, fn) in forms.items():
            t, outs[name] = gen(m, fn)
            g_us[name].append(t)
        for name, (m, fn) in forms.items():
            s_us[name].append(steps(m, fn))
    e, es = statistics.median(g_us["eager"]), statistics.median(s_us["eager"])
    for name in forms:
        gm, sm = statistics.median(g_us[name]), statistics.median(s_us[name])
        print(f"{name:16s} generate {gm:6.0f} µs/token ({e / gm:.2f}x eager), decode step "
              f"{sm:6.0f} µs ({es / sm:.2f}x); tokens equal eager "
              f"{torch.equal(outs[name], outs['eager'])}")
    s = cg.stats(installed)
    print(f"function pieces (all regions): captures {s.captures}, replays {s.replays}, eager "
          f"{dict(list(s.eager_calls.items())[:3])}")
