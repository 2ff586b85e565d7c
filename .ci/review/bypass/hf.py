"""Review of a8abf78 (_fast.Bypass) on a GPU with HF models built from a config (random
weights, no network): GPT-2 and Llama, piecewise under cudagraphify, called under grad mode with
their outputs kept (the bypass arms), then backward; three ways (bypass on, bypass off, eager)
and an eager twin. See common.py for the line format. ``python hf.py`` (DEV=cpu: CPU double)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, DEV, check, differential, info, skip  # noqa: E402

import torch  # noqa: E402

try:
    import transformers
except Exception as e:  # noqa: BLE001
    skip("hf", f"transformers not importable: {type(e).__name__}: {e}")
    sys.exit(0)


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                  n_positions=64, attn_pdrop=0.0, embd_pdrop=0.0,
                                  resid_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def ids(use_cache):
    gen = torch.Generator().manual_seed(5)
    kw = {} if use_cache is None else {"use_cache": use_cache}
    while True:
        yield (torch.randint(0, 128, (2, 16), generator=gen).to(DEV),), kw


if __name__ == "__main__":
    info(f"device {DEV}{' (CPU double)' if CPU else ''}, torch {torch.__version__}, "
         f"transformers {transformers.__version__}")
    for name, make in (("gpt2", gpt2), ("llama", llama)):
        for use_cache in (False, None):
            label = f"HF {name} ({'use_cache=False' if use_cache is False else 'default kwargs'})"
            try:
                differential(label, make, ids(use_cache), out=lambda o: o.logits)
            except Exception as e:  # noqa: BLE001
                check(False, f"[control] {label}", f"{type(e).__name__}: {str(e)[:300]}")
    sys.exit(0)
