"""Shared helpers for the share_graph + static cache GPU reproductions (review)."""
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
warnings.simplefilter("ignore")

import torch  # noqa: E402
import cudagraphify as cg  # noqa: E402

DEV = os.environ.get("REVIEW_DEV", "cuda")  # (cpu: a dry run of the scripts)


def report(name, bad, group=None):
    extra = ""
    if group is not None:
        s = group.stats()
        extra = (f" captures={s.captures} retargets={s.retargets} per_layer={s.per_layer} "
                 f"reasons={dict(list(s.reasons.items())[:3])}")
    print(("FAIL " if bad else "PASS ") + name + (f" {bad[:6]}" if bad else "") + extra,
          flush=True)


def llama(layers=4, seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000)
    ref = transformers.LlamaForCausalLM(cfg).to(DEV, torch.bfloat16).eval()
    model = copy.deepcopy(ref)
    group = cg.share_graph(model.model.layers)
    return cfg, ref, model, group


def static_cache(cfg, n):
    import transformers
    return transformers.StaticCache(config=cfg, max_cache_len=n)


def cache_diffs(rc, c, tag):
    bad = []
    for i, (a, b) in enumerate(zip(rc.layers, c.layers)):
        if a.keys is None and b.keys is None:
            continue
        if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
            bad.append(("cache", tag, i))
    return bad


def generate(ref, model, rc, c, prompt=6, steps=6, seed=0, tag=""):
    """Prefill + greedy decode on both; bitwise logits and caches at every step."""
    bad = []
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.randint(0, 1000, (1, prompt), device=DEV, generator=g)
    with torch.no_grad():
        pos = torch.arange(prompt, device=DEV)
        want = ref(input_ids=ids, past_key_values=rc, cache_position=pos, use_cache=True).logits
        got = model(input_ids=ids, past_key_values=c, cache_position=pos, use_cache=True).logits
        if not torch.equal(want, got):
            bad.append(("prefill", tag))
        bad += cache_diffs(rc, c, (tag, "prefill"))
        tok = want[:, -1:].argmax(-1)
        for s in range(steps):
            pos = torch.tensor([prompt + s], device=DEV)
            want = ref(input_ids=tok, past_key_values=rc, cache_position=pos,
                       use_cache=True).logits
            got = model(input_ids=tok, past_key_values=c, cache_position=pos,
                        use_cache=True).logits
            if not torch.equal(want, got):
                bad.append(("logits", tag, s))
            bad += cache_diffs(rc, c, (tag, s))
            tok = want[:, -1:].argmax(-1)
    return bad


# -- a fake HF static cache for custom modules (recognised as a static state) ---------------

class Cache:
    def __init__(self, layers, **extra):
        self.layers = layers
        for k, v in extra.items():
            setattr(self, k, v)

    @property
    def is_compileable(self):
        return True


Cache.__module__ = "transformers.cache_utils"


class KV:
    is_compileable = True

    def __init__(self, d=64, max_len=16):
        self.keys = torch.zeros(1, max_len, d, device=DEV)
        self.values = torch.zeros(1, max_len, d, device=DEV)
        self.max_len = max_len


def kv_cache(n=4, **extra):
    return Cache([KV() for _ in range(n)], **extra)


def all_tensors(cache):
    out = []
    for layer in cache.layers:
        out += [v for _, v in sorted(vars(layer).items()) if isinstance(v, torch.Tensor)]
    out += [v for _, v in sorted(vars(cache).items()) if isinstance(v, torch.Tensor)]
    return out


def custom_run(name, model_cls, layer_cls, make_cache, steps=8, n=4, pre=None):
    """Eager twin vs share_graph(model.layers); bitwise outputs and cache tensors."""
    torch.manual_seed(0)
    ref = model_cls(layer_cls, n).to(DEV).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = copy.deepcopy(ref)
    group = cg.share_graph(model.layers)
    rc, c = make_cache(), make_cache()
    bad = []
    g = torch.Generator(device=DEV).manual_seed(1)
    with torch.no_grad():
        for t in range(steps):
            x = torch.randn(1, 1, 64, device=DEV, generator=g)
            pos = torch.tensor([t], device=DEV)
            if pre is not None:
                pre(rc, t)
                pre(c, t)
            want, got = ref(x, rc, pos), model(x, c, pos)
            if not torch.equal(want, got):
                bad.append(("out", t))
            for i, (a, b) in enumerate(zip(all_tensors(rc), all_tensors(c))):
                if not torch.equal(a, b):
                    bad.append(("cache", t, i))
    report(name, bad, group)
    return bad
