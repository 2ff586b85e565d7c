"""review19: state_key on a CUDA build (the C address check, torch._C.
_tensors_data_ptrs_at_indices_equal, exists only there) for an 80-layer HF StaticCache.
One PASS/FAIL line per check."""
import time

import torch
import transformers
from transformers import StaticCache

from cudagraphify import _state


def check(ok, what, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)


def cache(layers=80):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=256)
    c = StaticCache(config=config, max_cache_len=64)
    c.early_initialization(1, 1, 32, torch.float16, torch.device("cuda"))
    return c


def per_call(fn, n=2000):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def main():
    check(_state.ptrs_equal is not None, "CUDA build: _state.ptrs_equal is torch's C check")
    c = cache()
    _state._memo.clear()
    k1 = _state.state_key(c)
    check(_state.state_key(c) is k1, "80 layers (keyable under 4096 values): a memo hit")
    layer = c.layers[57]
    layer.values.set_(torch.zeros_like(layer.values).untyped_storage())  # same object, moved
    k2 = _state.state_key(c)
    check(k2 != k1, "a layer tensor moved by set_ (no dict changed) gives a new key")
    check(_state.state_key(c) is k2, "then hits again")
    hit = per_call(lambda: _state.state_key(c))
    walk = per_call(lambda: (_state._memo.clear(), _state.state_key(c)), 200)
    print(f"INFO 80 layers: state_key memo hit {hit * 1e6:.1f} us, full walk {walk * 1e6:.0f} us")
    caches = [cache() for _ in range(17)]
    _state._memo.clear()

    def round_robin(cs):
        for x in cs:
            _state.state_key(x)

    sixteen = per_call(lambda: round_robin(caches[:16]), 50) / 16
    seventeen = per_call(lambda: round_robin(caches), 50) / 17
    check(seventeen < 3 * sixteen, "17 live caches used in turn cost about what 16 do per call",
          f"{seventeen * 1e6:.0f} us vs {sixteen * 1e6:.0f} us a call (_MAX_MEMO=16, FIFO)")


if __name__ == "__main__":
    main()
