"""GPU diagnosis (#16): HF Llama (8 layers, hidden 512, bf16) ``generate()`` with its default
DynamicCache, 64 tokens, one process, rounds in turn: eager; ``graphify(model)`` with the replay
path kept aside (``GraphedState._alt``, 67e0e31); the same with it off (``other_fast`` answering
MISS); then the same three as decode-step loops. Prints µs a token (median of 5 rounds), the
generate's cost over its decode steps, and the slow-path calls of each generate.

    source .device/install.sh && python3 .ci/diag/dyn_alt.py"""
import copy
import time
import statistics
import warnings
import torch
import transformers
import cudagraphify as cg
from cudagraphify import _engine
from cudagraphify._fast import MISS
warnings.simplefilter("ignore")
sizes = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=32000)
N = 64
cfg = transformers.LlamaConfig(**sizes, max_position_embeddings=32 + N + 8)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
prompt = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
greedy = dict(
    max_new_tokens=N,
    min_new_tokens=N,
    do_sample=False,
    pad_token_id=0,
    disable_compile=True)
on, off = cg.graphify(copy.deepcopy(model)), cg.graphify(copy.deepcopy(model))
real_other, real_slow = _engine.GraphedState.other_fast, _engine.GraphedState.slow
slow = [0]


def counting(self, fn, a, k):
    slow[0] += 1
    return real_slow(self, fn, a, k)


_engine.GraphedState.slow = counting
forms = {"eager": (model, True), "alt on": (on, True), "alt off": (off, False)}


def gen(m, alt):
    _engine.GraphedState.other_fast = real_other if alt else (lambda self, fn, a, k: MISS)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = m.generate(prompt, **greedy)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / N * 1e6, out


def steps(m, alt, n=32):
    _engine.GraphedState.other_fast = real_other if alt else (lambda self, fn, a, k: MISS)
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


with torch.no_grad():
    for _ in range(4):
        for name, (m, alt) in forms.items():
            gen(m, alt)
    g_us = {k: [] for k in forms}
    s_us = {k: [] for k in forms}
    slows = {k: [] for k in forms}
    outs = {}
    for r in range(5):
        for name, (m, alt) in forms.items():
            slow[0] = 0
            t, outs[name] = gen(m, alt)
            g_us[name].append(t)
            slows[name].append(slow[0])
        for name, (m, alt) in forms.items():
            s_us[name].append(steps(m, alt))
    e = statistics.median(g_us["eager"])
    es = statistics.median(s_us["eager"])
    for name in forms:
        gm, sm = statistics.median(g_us[name]), statistics.median(s_us[name])
        same = torch.equal(outs[name], outs["eager"])
        print(f"{name:8s} generate {gm:6.0f} us/token ({e / gm:.2f}x eager), decode step "
              f"{sm:6.0f} us ({es / sm:.2f}x), generate minus step {gm - sm:5.0f} us; slow "
              f"calls a generate {slows[name]}; tokens equal eager {same}")
