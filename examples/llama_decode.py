"""Greedy decode of an HF transformers Llama with a static KV cache: eager vs a graphed decode step.

    python examples/llama_decode.py          (needs: pip install transformers)

The model comes from a small config with random weights (nothing is downloaded). One decode step
is a plain function of the new token, its position and the cache; ``graphify`` captures it once
and replays it for every later token. The cache is named in ``static_argnames``: its tensors are
read and written in place (a static cache never moves them), and a graph is kept per cache
object. Everything that changes from step to step is a tensor (the token, its position), so one
graph serves every step. On a machine without a GPU everything runs eagerly (and says so), with
a tiny model.
"""

from __future__ import annotations

import inspect
import sys
import time
import warnings

import torch

import cudagraphify as cg


def static_cache(transformers, config, max_len: int, device, dtype):
    """A ``transformers.StaticCache`` for one sequence, with the constructor the installed
    version has (transformers 5 makes its tensors on the first update)."""
    try:
        return transformers.StaticCache(config=config, max_batch_size=1, max_cache_len=max_len,
                                        device=device, dtype=dtype)
    except TypeError:
        return transformers.StaticCache(config=config, max_cache_len=max_len)


def decode_step(model):
    """``step(token, position, cache)``: the next greedy token, (1, 1). Everything that changes
    from step to step is a tensor, so one graph serves every step."""
    params = inspect.signature(model.forward).parameters
    cache_name = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5

    def step(token, position, cache):
        extra = {"cache_position": position} if "cache_position" in params else {}  # 4.x
        out = model(input_ids=token, position_ids=position.unsqueeze(0), use_cache=True,
                    **{cache_name: cache}, **extra)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    return step


def generate(step, prefill, cache, prompt, positions, new_tokens: int):
    """Greedy decode: prefill eagerly, then one ``step`` per token. Returns the tokens (batch,
    new_tokens) and the seconds the decode steps took (prefill excluded)."""
    cache.reset()  # zeroes the cache in place: its tensors keep their addresses
    p = prompt.shape[1]
    token = prefill(prompt, torch.arange(p, device=prompt.device), cache)
    tokens = [token]
    if prompt.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(new_tokens - 1):
        token = step(token, positions[i:i + 1], cache)
        tokens.append(token)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return torch.cat(tokens, dim=1), time.perf_counter() - t0


def main() -> None:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install transformers): nothing to run")
        sys.exit(0)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:  # the decode anchor of the design notes
        sizes = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)
        dtype, prompt_len, new_tokens = torch.bfloat16, 32, 64
    else:  # tiny, so that it runs in seconds on a CPU
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        dtype, prompt_len, new_tokens = torch.float32, 8, 16
    config = transformers.LlamaConfig(**sizes, max_position_embeddings=prompt_len + new_tokens)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), device=device)
    positions = torch.arange(prompt_len, prompt_len + new_tokens, device=device)

    step = decode_step(model)
    graphed_step = cg.graphify(step, static_argnames=("cache",))
    caches = [static_cache(transformers, config, prompt_len + new_tokens, device, dtype)
              for _ in range(2)]  # one for eager, one for the graph
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        results = {}
        for name, fn, cache in (("eager", step, caches[0]),
                                ("graphify", graphed_step, caches[1])):
            runs = [generate(fn, step, cache, prompt, positions, new_tokens) for _ in range(3)]
            # the first run of the graphed step warms up and captures: time the later ones
            results[name] = (runs[0][0], min(seconds for _, seconds in runs[1:]))
            for tokens, _ in runs[1:]:
                assert torch.equal(tokens, runs[0][0]), f"{name}: runs generated other tokens"
    (eager_tokens, eager_s), (graph_tokens, graph_s) = results["eager"], results["graphify"]
    assert torch.equal(graph_tokens, eager_tokens), "graphify generated other tokens than eager"
    s = cg.stats(graphed_step)
    print(f"generated tokens equal eager over {new_tokens} tokens x 3 runs "
          f"(Llama, {sizes['num_hidden_layers']} layers, hidden {sizes['hidden_size']}, "
          f"{str(dtype).removeprefix('torch.')}, transformers {transformers.__version__}, "
          f"on {device})")
    print(f"captures={s.captures} replays={s.replays} eager calls={s.eager}")
    if not on_gpu:
        reason = next(iter(s.eager_calls), "no reason recorded")
        print(f"no CUDA GPU here: the decode step ran eagerly ({reason})")
        return
    steps = new_tokens - 1
    eager_tps, graph_tps = steps / eager_s, steps / graph_s
    print(f"decode: eager {eager_tps:.0f} tokens/s, graphify {graph_tps:.0f} tokens/s, "
          f"speed-up {graph_tps / eager_tps:.1f}x")


if __name__ == "__main__":
    main()
