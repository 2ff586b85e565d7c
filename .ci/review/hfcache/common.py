"""Shared bits of the review17 GPU scripts: HF transformers caches passed to graphify(model).

Every check runs an eager twin (a deep copy made before graphify) with its own cache and compares
tokens, logits and cache contents bitwise (torch.equal); one line per check: PASS or FAIL, with
cudagraphify.stats counters. Without a GPU (REVIEW17_CPU=1, or no CUDA) the scripts run on the
CPU double of tests/conftest.py with the device-counter stand-in of tests/test_review_hfcache.py
(a smoke test of the scripts themselves; the GPU is what they are for)."""
import copy
import os
import sys
import time
import warnings

import torch

import cudagraphify as cg
import transformers
from transformers import StaticCache, cache_utils

warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()

GPU = torch.cuda.is_available() and os.environ.get("REVIEW17_CPU") != "1"
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
if not GPU:  # the CPU double (see the module docstring)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "..", "tests"))
    from conftest import SimBackend
    from cudagraphify import _capture
    from test_review_hfcache import DevStaticLayer
    _capture.set_backend(SimBackend())
    cache_utils.STATIC_LAYER_TYPE_MAPPING["full_attention"] = DevStaticLayer

RESULTS = []
_MODELS = {}


def model(seed=0):
    """The tiny Llama of tests/test_gpu_hf.py (its outputs equal eager's there, bitwise)."""
    if seed not in _MODELS:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=128,
                                          pad_token_id=0)
        torch.manual_seed(seed)
        m = transformers.LlamaForCausalLM(config).to(DEV, DTYPE).eval()
        m.generation_config.pad_token_id = 0
        _MODELS[seed] = m
    m = copy.deepcopy(_MODELS[seed])
    return m, m.config


def pair(seed=0, **options):
    ref, config = model(seed)
    return ref, cg.graphify(copy.deepcopy(ref), **options), config


def static(config, n=32):
    return StaticCache(config=config, max_cache_len=n)


def early(cache, config, batch=1, dtype=None):
    cache.early_initialization(batch, config.num_key_value_heads,
                               config.hidden_size // config.num_attention_heads,
                               dtype or DTYPE, torch.device(DEV))
    return cache


def same_cache(a, b):
    for x, y in zip(a.layers, b.layers):
        if (x.keys is None) != (y.keys is None):
            return False
        if x.keys is not None and not (torch.equal(x.keys, y.keys)
                                       and torch.equal(x.values, y.values)):
            return False
        if hasattr(x, "cumulative_length") and not torch.equal(
                torch.as_tensor(x.cumulative_length).cpu(),
                torch.as_tensor(y.cumulative_length).cpu()):
            return False
    return True


class Diff:
    """Bitwise comparisons of one check, remembered: ok, and a short account of the first."""

    def __init__(self):
        self.first = None
        self.worst = 0.0
        self.n = 0

    def logits(self, got, want, what):
        self.n += 1
        if not torch.equal(got, want):
            d = (got.float() - want.float()).abs().max().item()
            self.worst = max(self.worst, d)
            self.first = self.first or f"{what}: logits differ (max {d:.3g})"

    def cache(self, rc, c, what):
        if not same_cache(rc, c):
            self.first = self.first or f"{what}: cache contents differ"

    def tokens(self, a, b, what):
        self.n += 1
        if not torch.equal(a, b):
            self.first = self.first or f"{what}: tokens differ"

    @property
    def ok(self):
        return self.first is None


def stats(g):
    s = cg.stats(g)
    eager = {k[:70]: v for k, v in s.eager_calls.items()}
    return (f"captures={s.captures} replays={s.replays} retargets={s.retargets} "
            f"set_ups={s.set_ups} eager={eager} reasons={dict(s.reasons)}")


def check(ok, what, detail=""):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f" [{detail}]" if detail else ""), flush=True)


def guarded(what, fn):
    """Run one check; an exception is a FAIL line, not a crash of the script."""
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            fn()
    except Exception as e:  # noqa: BLE001
        check(False, what, f"raised {type(e).__name__}: {str(e)[:200]}")
    print(f"  ({what}: {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)


def decode(ref, g, rc, c, ids, steps, diff, what, **kw):
    """A prefill of ``ids`` then greedy one-token steps, eager twin against graphed."""
    x = ids
    for t in range(steps):
        want = ref(x, past_key_values=rc, use_cache=True, **kw).logits
        got = g(x, past_key_values=c, use_cache=True, **kw).logits
        diff.logits(got, want, f"{what} step {t}")
        diff.cache(rc, c, f"{what} step {t}")
        x = want[:, -1:].argmax(-1)
    return x


GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
           output_logits=True, return_dict_in_generate=True)


def generate(ref, g, ids, diff, what, **kw):
    want = ref.generate(ids, disable_compile=True, **GEN, **kw)
    got = g.generate(ids, **GEN, **kw)
    diff.tokens(got.sequences, want.sequences, what)
    for t, (a, b) in enumerate(zip(got.logits, want.logits)):
        diff.logits(a, b, f"{what} token {t}")
    return want, got


def ids(batch, length, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (batch, length), generator=gen).to(DEV)
