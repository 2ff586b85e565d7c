"""HF transformers ``model.generate()`` with a static cache or its default one, graphified with no
option.

    python examples/hf_generate.py          (needs: pip install transformers)

What a user writes: ``graphify(model)``, then ``model.generate(...)`` as before. A static cache
(``cache_implementation="static"``, or a ``StaticCache`` passed in) is recognised: its tensors
are read and written in place, and every decode step replays one graph. The first step of a
fresh cache runs eagerly (it allocates the cache's tensors), the next one captures. A cache
that generate() makes anew for every call: the first two calls capture (the second capture,
diffed with the first, proves they differ only in the caches' addresses), later calls replay
the first graph rebased to their cache's memory; a ``StaticCache`` you keep and pass again
keeps its graphs. The prefill runs eagerly (a new cache's first update allocates it) or
piecewise (transformers' mask building syncs on its eager path). With no cache option generate()
makes a ``DynamicCache``, which grows every step: the attention over it runs eagerly, the norms,
projections, MLPs and the rotary embedding around it are graphed as pieces. Greedy tokens equal
eager's.

generate() wraps the forward of a model with a static cache in torch.compile by default;
graphify turns that off for the model it graphs (``generation_config.disable_compile``), and
the eager runs below turn it off too, so that "eager" is the model as written. The model comes
from a small config with random weights (nothing is downloaded). Without a GPU everything runs
eagerly (and says so), with a tiny model.
"""

from __future__ import annotations

import sys
import time
import warnings

import torch

import cudagraphify as cg


def timed_generate(model, prompt, runs: int, **kwargs):
    """The tokens of the first of ``runs`` calls of ``generate`` (all must agree), its seconds,
    and the best seconds per call of the others. A cache passed in is reset before each call
    (generate continues a cache it is given)."""
    outs, seconds = [], []
    for _ in range(runs):
        if "past_key_values" in kwargs:
            kwargs["past_key_values"].reset()  # zeroes it in place: its graphs stay valid
        if prompt.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs.append(model.generate(prompt, **kwargs))
        if prompt.is_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    for out in outs[1:]:
        assert torch.equal(out, outs[0]), "generate gave other tokens on another call"
    return outs[0], seconds[0], min(seconds[1:])


def main() -> None:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install transformers): nothing to run")
        sys.exit(0)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        sizes = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
        dtype, prompt_len, new_tokens, runs = torch.bfloat16, 32, 64, 6
    else:  # tiny, so that it runs in seconds on a CPU
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        dtype, prompt_len, new_tokens, runs = torch.float32, 8, 8, 2
    config = transformers.LlamaConfig(**sizes, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), device=device)
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    kept_eager = transformers.StaticCache(config=config, max_cache_len=prompt_len + new_tokens)
    kept_graph = transformers.StaticCache(config=config, max_cache_len=prompt_len + new_tokens)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        eager = {
            "static": timed_generate(model, prompt, runs, cache_implementation="static",
                                     disable_compile=True, **greedy),
            "kept": timed_generate(model, prompt, runs, past_key_values=kept_eager,
                                   disable_compile=True, **greedy),
            "dynamic": timed_generate(model, prompt, runs, disable_compile=True, **greedy),
        }
        cg.graphify(model)  # <- the one line
        graphed = {
            "static": timed_generate(model, prompt, runs, cache_implementation="static",
                                     **greedy),
            "kept": timed_generate(model, prompt, runs, past_key_values=kept_graph, **greedy),
            "dynamic": timed_generate(model, prompt, runs, **greedy),
        }
    s = cg.stats(model)
    print(f"Llama, {sizes['num_hidden_layers']} layers, hidden {sizes['hidden_size']}, "
          f"{str(dtype).removeprefix('torch.')}, transformers {transformers.__version__}, "
          f"on {device}; {new_tokens} new tokens, greedy")
    for name, label in (("static", 'cache_implementation="static"'),
                        ("kept", "a StaticCache passed in, kept across calls"),
                        ("dynamic", "no cache option (its DynamicCache)")):
        (e_tokens, _, e_s), (g_tokens, g_first, g_s) = eager[name], graphed[name]
        assert torch.equal(g_tokens, e_tokens), f"{label}: graphify generated other tokens"
        line = f"{label}: tokens equal eager's"
        if on_gpu:
            line += (f"; eager {new_tokens / e_s:.0f} tokens/s, graphify "
                     f"{new_tokens / g_s:.0f} tokens/s ({e_s / g_s:.1f}x); first graphified "
                     f"generate {g_first:.2f} s")
        print(line)
    print(f"captures={s.captures} replays={s.replays} eager calls={s.eager}")
    if not on_gpu:
        reason = next(iter(s.eager_calls), "no reason recorded")
        print(f"no CUDA GPU here: generate ran eagerly ({reason})")


if __name__ == "__main__":
    main()
