"""Shared bits of the review scripts for b8e0eed (a static cache whose Python state the forward
changes is demoted to an opaque object) and c6fd56d (a region graph blocked by a later graph's
held output is captured again).

DEV=cuda (default) runs on the GPU in bf16. DEV=cpu runs the same checks on the CPU double of
tests/conftest.py (SimBackend), with the device-counter stand-in of tests/test_review_hfcache.py
for HF's StaticLayer: this smoke-tests the scripts and does not stand in for the GPU. Checks
that need streams print INFO lines there. One line per check: PASS / FAIL / INFO.
Every value is compared with an eager twin (a deep copy made before graphify), bitwise."""
import copy
import os
import sys
import time
import warnings

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture, _engine, _state
import transformers
from transformers import DynamicCache, StaticCache, cache_utils

warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()

DEV = os.environ.get("DEV", "cuda")
if DEV == "cuda" and not torch.cuda.is_available():
    print("INFO no CUDA device: DEV=cpu (the CPU double) instead", flush=True)
    DEV = "cpu"
GPU = DEV == "cuda"
DTYPE = torch.bfloat16 if GPU else torch.float32
if not GPU:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "..", "tests"))
    from conftest import SimBackend  # noqa: E402
    from test_review_hfcache import DevStaticLayer  # noqa: E402
    _capture.set_backend(SimBackend())
    cache_utils.STATIC_LAYER_TYPE_MAPPING["full_attention"] = DevStaticLayer
# No piece trial: it decides by the machine's speed whether a piece keeps its graph, which
# would make the counters below depend on timing. Timings here are INFO lines only.
_capture.CudaBackend.clock = None
RESULTS = []


def check(ok, what, detail=""):
    RESULTS.append(bool(ok))
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f" [{detail}]" if detail else ""), flush=True)


def info(what, detail=""):
    print(f"INFO {what}" + (f" [{detail}]" if detail else ""), flush=True)


def guarded(what, fn):
    """One check; an exception is a FAIL line, not the end of the script."""
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            fn()
    except Exception as e:  # noqa: BLE001
        check(False, what, f"raised {type(e).__name__}: {str(e)[:200]}")
    print(f"  ({what}: {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)


def sync():
    if GPU:
        torch.cuda.synchronize()


def stats(g):
    s = cg.stats(g)
    eager = {k[:60]: v for k, v in s.eager_calls.items()}
    return f"captures={s.captures} replays={s.replays} eager={eager}"


def root(g):
    """The counters of ``g`` itself (cg.stats adds those of its pieces)."""
    from cudagraphify.api import _state_of
    state = _state_of(g)
    return state.stats() if state is not None else cg.Stats()


def demoted(x):
    """Whether ``x`` was demoted (``_state.demoted`` answers a bool or the reason)."""
    return bool(_state.demoted(x))


def count(g, *words, own=False):
    s = root(g) if own else cg.stats(g)
    return sum(n for r, n in s.eager_calls.items() if any(w in r for w in words))


OPAQUE = "has Python state that the forward changes"
SIDE = "side effect"


def ids(batch, length, seed, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=gen).to(DEV)


_BASE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             pad_token_id=0)


def hf(kind="llama", seed=0):
    """A tiny HF causal LM on DEV in DTYPE: llama (full attention), qwen2 (layer 1 sliding,
    window 6), mistral (every layer sliding, window 6)."""
    if kind == "llama":
        cls, model_cls, extra = transformers.LlamaConfig, transformers.LlamaForCausalLM, {}
    elif kind == "qwen2":
        cls, model_cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
        extra = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    else:
        cls, model_cls = transformers.MistralConfig, transformers.MistralForCausalLM
        extra = dict(sliding_window=6)
    config = cls(**_BASE, **extra)
    torch.manual_seed(seed)
    m = model_cls(config).to(DEV, DTYPE).eval()
    m.generation_config.pad_token_id = 0
    return m, config


def static(config, n=64):
    return StaticCache(config=config, max_cache_len=n)


def same_cache(a, b):
    for x, y in zip(a.layers, b.layers):
        if (getattr(x, "keys", None) is None) != (getattr(y, "keys", None) is None):
            return False
        if getattr(x, "keys", None) is not None and not (
                torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)):
            return False
    return True


GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
           output_logits=True, return_dict_in_generate=True)


def same_generate(a, b):
    return torch.equal(a.sequences, b.sequences) and len(a.logits) == len(b.logits) and all(
        torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def per_call_ms(fn, n=20):
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e3
