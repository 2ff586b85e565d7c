"""The decode row of the benchmark: greedy decode of an HF transformers Llama from a small
config (random weights, nothing downloaded) with a static KV cache, eager vs a graphed step.

    python -m cudagraphify.bench --decode [--decode-tokens N] [--decode-batch B]
"""

from __future__ import annotations

import copy
import inspect
import statistics
import time

import torch

from ._common import chaining, error_text, free_memory, progress

# Greedy decode of an HF transformers Llama from a small config (random weights, nothing
# downloaded) with a static KV cache: the decode anchor of the design notes.
DECODE_SIZES = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)
# On a CPU (eager only) a tiny one, to stay quick.
DECODE_CPU_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def static_cache(transformers, config, batch: int, max_len: int, device, dtype):
    """A ``transformers.StaticCache``, whatever the installed version's constructor wants."""
    tries = (
        # 4.50 and later (since 4.56 and in 5.x, device and dtype come from the first update)
        dict(config=config, max_batch_size=batch, max_cache_len=max_len, device=device,
             dtype=dtype),
        dict(config=config, max_cache_len=max_len),
        dict(config=config, batch_size=batch, max_cache_len=max_len, device=device, dtype=dtype),
    )
    for kwargs in tries:
        try:
            return transformers.StaticCache(**kwargs)
        except TypeError as e:
            error = e
    raise error


def cache_keyword(model) -> str:
    """The name under which ``model.forward`` takes the KV cache (``cache`` since transformers
    5.2x, ``past_key_values`` before) and its output returns it."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"


def decode_step(model):
    """``step(input_ids, cache_position, cache)``: one greedy token per sequence, (batch, 1).
    Every per-step value is a tensor, so one graph serves every step."""
    # transformers 4.x takes cache_position (where the static cache writes); 5.x keeps that
    # position in the cache (a tensor) and takes position_ids only.
    takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
    keyword = cache_keyword(model)

    def step(input_ids, cache_position, cache):
        extra = {"cache_position": cache_position} if takes_cache_position else {}
        out = model(input_ids=input_ids, position_ids=cache_position.unsqueeze(0),
                    use_cache=True, **{keyword: cache}, **extra)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    return step


def _generate(step, prefill, cache, prompt, positions, new_tokens: int, sync,
              time_first: bool = False):
    """Prefill eagerly, then ``new_tokens - 1`` decode steps. Returns the tokens (batch,
    new_tokens), the seconds of the decode steps, and (``time_first``) of the first one alone."""
    cache.reset()  # in place: the cache's tensors keep their addresses
    token = prefill(prompt, torch.arange(prompt.shape[1], device=prompt.device), cache)
    tokens = [token]
    sync()
    t0 = time.perf_counter()
    first = None
    for i in range(new_tokens - 1):
        token = step(token, positions[i:i + 1], cache)
        tokens.append(token)
        if time_first and i == 0:
            sync()
            first = time.perf_counter() - t0
    sync()
    return torch.cat(tokens, dim=1), time.perf_counter() - t0, first


def bench_decode(new_tokens: int = 64, repeats: int = 5, batch: int = 1, prompt_len: int = 32,
                 device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 sizes: dict | None = None) -> dict:
    """Greedy decode, eager vs ``graphify`` of the decode step (CUDA only): tokens/s, µs per
    step, whether the tokens are identical to eager's. Prefill runs eagerly and is not timed;
    the graphed step's first run (warm-up and capture on its first step) is not timed either."""
    sizes = sizes or DECODE_SIZES
    row: dict = {"workload": "llama-decode", "device": device, "batch": batch,
                 "prompt": prompt_len, "new_tokens": new_tokens}
    try:
        import transformers
    except Exception as e:
        row["error"] = f"transformers is not importable ({error_text(e, 160)})"
        return row
    try:
        _decode_into(row, transformers, new_tokens, repeats, batch, prompt_len, device, dtype,
                     sizes)
    except Exception as e:  # an API this code did not foresee: say so, keep the other rows
        row["error"] = error_text(e)
    return row


def _decode_into(row, transformers, new_tokens, repeats, batch, prompt_len, device, dtype,
                 sizes) -> None:
    import cudagraphify as cg

    on_gpu = device != "cpu"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    config = transformers.LlamaConfig(**sizes, max_position_embeddings=prompt_len + new_tokens)
    row["config"] = (f"Llama {sizes}, {str(dtype).removeprefix('torch.')}, "
                     f"transformers {transformers.__version__}")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), device=device)
    positions = torch.arange(prompt_len, prompt_len + new_tokens, device=device)
    step = decode_step(model)
    steps = new_tokens - 1

    def timed(fn, cache, label):
        runs = [_generate(fn, step, cache, prompt, positions, new_tokens, sync)
                for _ in range(repeats)]
        seconds = statistics.median(s for _, s, _ in runs)
        row[f"{label}_us"] = seconds / steps * 1e6
        row[f"{label}_tokens_per_s"] = batch * steps / seconds
        return [t for t, _, _ in runs]

    with torch.no_grad():
        progress(f"llama-decode: eager ({new_tokens} tokens, {repeats} runs)")
        eager_cache = static_cache(transformers, config, batch, prompt_len + new_tokens,
                                    device, dtype)
        ref, _, _ = _generate(step, step, eager_cache, prompt, positions, new_tokens, sync)
        if on_gpu:  # the extra peak memory of one eager decode run (its cache already made)
            free_memory()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _generate(step, step, eager_cache, prompt, positions, new_tokens, sync)
            row["eager_peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        eager_runs = timed(step, eager_cache, "eager")
        row["eager_runs_identical"] = all(torch.equal(t, ref) for t in eager_runs)
        if not on_gpu:
            return
        progress("llama-decode: graphify (the first decode step warms up and captures)")
        graphed = cg.graphify(step, static_argnames=("cache",))
        cache = static_cache(transformers, config, batch, prompt_len + new_tokens, device,
                              dtype)
        # transformers 5 allocates a static cache's tensors on its first update: make them
        # before measuring, so that the peak below is the graph's, not the cache's
        _generate(step, step, cache, prompt, positions, 2, sync)
        free_memory()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        first_tokens, _, first = _generate(graphed, step, cache, prompt, positions, new_tokens,
                                           sync, time_first=True)
        row["graphify_first_call_s"] = first
        row["graphify_peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        graph_runs = timed(graphed, cache, "graphify")
        graph_tokens = [first_tokens] + graph_runs
        row["tokens_identical"] = all(torch.equal(t, ref) for t in graph_tokens)
        if not row["tokens_identical"]:
            bad = next(t for t in graph_tokens if not torch.equal(t, ref))
            row["first_differing_token"] = int((bad != ref).any(0).nonzero()[0])
        s = cg.stats(graphed)
        row["graphify_captures"], row["graphify_replays"] = s.captures, s.replays
        row["graphify_eager_calls"] = dict(s.eager_calls)
        row["graphify_pool_mb"] = s.graph_pool_bytes / 2**20
        cg.ungraphify(graphed)
    row["graphify_vs_eager"] = row["graphify_us"] / row["eager_us"]
    row["graphify_speedup"] = row["graphify_tokens_per_s"] / row["eager_tokens_per_s"]
    _generate_rows(row, transformers, config, model, prompt, new_tokens, repeats, sync)
    _sliding_rows(row, transformers, sizes, prompt, new_tokens, repeats, sync, dtype)


def _sliding_rows(row, transformers, sizes, prompt, new_tokens, repeats, sync, dtype) -> None:
    """``generate()`` of a Mistral of the same sizes whose sliding window (half the prompt)
    fills during the prompt: HF's sliding-window cache layers count the tokens seen in a Python
    int, so no whole-model graph can replay; the model runs eagerly around its cache, its
    pieces graphed. Eager vs ``graphify(model)``, with ``cache_implementation="static"`` and
    with its default cache: tokens/s, first generate, tokens identical, side effects learnt."""
    import cudagraphify as cg

    window = max(2, prompt.shape[1] // 2)
    config = transformers.MistralConfig(**sizes, sliding_window=window,
                                        max_position_embeddings=prompt.shape[1] + new_tokens)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).to(device=prompt.device, dtype=dtype).eval()
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    graphed = cg.graphify(copy.deepcopy(model))
    row["sliding_window"] = window
    for key, extra in (("static", {"cache_implementation": "static"}), ("dynamic", {})):
        progress(f"mistral-generate, sliding window {window} ({key}): eager, then graphify")
        before = cg.stats(graphed)
        results = _generates([(name, m, lambda own=own: dict(greedy, **extra, **own), True)
                              for name, m, own in (("eager", model, {"disable_compile": True}),
                                                   ("graphify", graphed, {}))],
                             prompt, repeats, sync)
        e_outs, g_outs = _rates(row, f"sliding_{key}", results, new_tokens * prompt.shape[0])
        after = cg.stats(graphed)
        row[f"sliding_{key}_captures"] = after.captures - before.captures
        row[f"sliding_{key}_replays"] = after.replays - before.replays
        # calls probed that showed the cache's side effect (two per cache, then it is demoted)
        row[f"sliding_{key}_side_effects"] = sum(
            n - before.eager_calls.get(r, 0) for r, n in after.eager_calls.items()
            if "side effect" in r)
        row[f"sliding_{key}_tokens_identical"] = all(torch.equal(o, e_outs[0])
                                                     for o in e_outs + g_outs)
    cg.ungraphify(graphed)


def _generates(runs: list, prompt, repeats: int, sync) -> dict:
    """``repeats + 1`` calls of ``model.generate(prompt, **kwargs_of())`` for each ``(name,
    model, kwargs_of, chained)`` of ``runs``, in turn (one call of each, then the next round),
    so that a host that speeds up or slows down during the row moves every form alike: each
    name's outputs and seconds (from one device synchronisation to the next)."""
    results: dict = {name: ([], []) for name, *_ in runs}
    for _ in range(repeats + 1):
        for name, model, kwargs_of, chained in runs:
            outs, seconds = results[name]
            kwargs = kwargs_of()
            with chaining(chained):
                sync()
                t0 = time.perf_counter()
                outs.append(model.generate(prompt, **kwargs))
                sync()
            seconds.append(time.perf_counter() - t0)
    return results


def _rates(row: dict, prefix: str, results: dict, tokens: int) -> tuple[list, list]:
    """Eager's and graphify's tokens/s (the median of the calls after the first), the speed-up
    and graphify's first call, into ``row`` under ``prefix``; their outputs."""
    (e_outs, e_s), (g_outs, g_s) = results["eager"], results["graphify"]
    e_tps = tokens / statistics.median(e_s[1:])
    g_tps = tokens / statistics.median(g_s[1:])
    row[f"{prefix}_eager_tokens_per_s"] = e_tps
    row[f"{prefix}_graphify_tokens_per_s"] = g_tps
    row[f"{prefix}_speedup"] = g_tps / e_tps
    row[f"{prefix}_first_s"] = g_s[0]
    return e_outs, g_outs


# the forms of generate() a user writes: (key, label, cache form, tokens/s target over eager)
GENERATE_FORMS = (
    ("static", 'cache_implementation="static"', "static", 5.0),
    ("kept", "a StaticCache passed in, kept (reset) across calls", "kept", 5.0),
    # (a cache that grows every step: the model runs piecewise, its attention eager)
    ("dynamic", "no cache option (its DynamicCache)", "dynamic", 1.5),
)


def _generate_rows(row, transformers, config, model, prompt, new_tokens, repeats, sync) -> None:
    """``model.generate()`` as a user calls it, greedy: eager (generate's own torch.compile
    off, the model as written) vs ``graphify(model)`` with no option, for each form of
    :data:`GENERATE_FORMS`: tokens/s (the median of ``repeats`` calls after the first; eager
    and each graphified copy called in turn, see :func:`_generates`), the first graphified
    call's seconds, tokens identical."""
    import cudagraphify as cg

    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    max_len = prompt.shape[1] + new_tokens
    graphed = cg.graphify(copy.deepcopy(model))
    # the dynamic form also runs a copy whose pieces are not chained (each copies in and
    # clones out), to show what chaining buys, in this process
    unchained = cg.graphify(copy.deepcopy(model))
    # and a copy with segments on (experimental): the runs of calls between the attention over
    # the growing cache graphed
    segmented = cg.graphify(copy.deepcopy(model), segments=True)
    for key, _, form, _ in GENERATE_FORMS:
        progress(f"llama-generate ({key}): eager, then graphify(model)")
        before = cg.stats(graphed)
        runs = [("eager", model, {"disable_compile": True}), ("graphify", graphed, {})]
        if form == "dynamic":
            runs.append(("unchained", unchained, {}))
            runs.append(("segments", segmented, {}))
        timed = []
        for name, m, extra in runs:
            cache = static_cache(transformers, config, prompt.shape[0], max_len, prompt.device,
                                 next(model.parameters()).dtype) if form == "kept" else None

            def kwargs_of(cache=cache, extra=extra):
                kwargs = dict(greedy, **extra)
                if cache is not None:
                    cache.reset()
                    kwargs["past_key_values"] = cache
                elif form == "static":
                    kwargs["cache_implementation"] = "static"
                return kwargs

            timed.append((name, m, kwargs_of, name != "unchained"))
        results = _generates(timed, prompt, repeats, sync)
        e_outs, g_outs = _rates(row, f"generate_{key}", results, new_tokens * prompt.shape[0])
        after = cg.stats(graphed)
        row[f"generate_{key}_captures"] = after.captures - before.captures
        row[f"generate_{key}_replays"] = after.replays - before.replays
        row[f"generate_{key}_rebased"] = after.retargets - before.retargets
        row[f"generate_{key}_set_ups"] = after.set_ups - before.set_ups
        row[f"generate_{key}_build_s"] = after.capture_seconds - before.capture_seconds
        row[f"generate_{key}_tokens_identical"] = all(torch.equal(o, e_outs[0])
                                                      for o in e_outs + g_outs)
        for other in ("unchained", "segments"):
            if other not in results:
                continue
            u_outs, u_s = results[other]
            row[f"generate_{key}_{other}_tokens_per_s"] = \
                new_tokens * prompt.shape[0] / statistics.median(u_s[1:])
            row[f"generate_{key}_{other}_first_s"] = u_s[0]
            row[f"generate_{key}_{other}_tokens_identical"] = all(
                torch.equal(o, e_outs[0]) for o in u_outs)
        if "segments" in results:
            plans = segmented._cudagraphify_state.segments.plans()
            seg = cg.stats(segmented)
            row[f"generate_{key}_segments"] = seg.segments
            row[f"generate_{key}_segment_replays"] = seg.segment_replays
            row[f"generate_{key}_segments_plan"] = [
                line for p in plans for line in p.describe()
                if "graphed" in line or "timed" in line or "given back" in line]
    s = cg.stats(graphed)
    row["generate_captures"], row["generate_replays"] = s.captures, s.replays
    row["generate_evictions"] = s.evictions
    row["generate_not_rebased"] = list(s.reasons)
    cg.ungraphify(graphed)
    cg.ungraphify(unchained)
    cg.ungraphify(segmented)


def format_decode(row: dict) -> str:
    """One decode row in words."""
    if "error" in row:
        return f"llama-decode: not run: {row['error']}"
    text = (f"llama-decode ({row['config']}; batch {row['batch']}, prompt {row['prompt']}, "
            f"{row['new_tokens']} new tokens): eager {row['eager_tokens_per_s']:.0f} tokens/s "
            f"({row['eager_us']:.0f} µs/step)")
    if "graphify_us" not in row:
        return text + f" on the {row['device']}"
    text += (
        f", graphify {row['graphify_tokens_per_s']:.0f} tokens/s ({row['graphify_us']:.0f} "
        f"µs/step), speed-up {row['graphify_speedup']:.2f}x; tokens identical to eager: "
        f"{row['tokens_identical']}; first graphed step {row['graphify_first_call_s']:.3f} s, "
        f"peak +{row['graphify_peak_mb']:.1f} MB; captures {row['graphify_captures']}, replays "
        f"{row['graphify_replays']}, eager calls {row['graphify_eager_calls'] or 0}")
    for key, label, _, target in GENERATE_FORMS:
        if f"generate_{key}_speedup" not in row:
            continue
        speedup, first = row[f"generate_{key}_speedup"], row[f"generate_{key}_first_s"]
        text += (
            f"\n  model.generate(), {label}: eager {row[f'generate_{key}_eager_tokens_per_s']:.0f}"
            f" tokens/s (its torch.compile off), graphify(model) "
            f"{row[f'generate_{key}_graphify_tokens_per_s']:.0f} tokens/s, {speedup:.2f}x "
            f"(target >= {target:g}x: {'met' if speedup >= target else 'MISSED'}); first "
            f"graphified generate {first:.3f} s"
            # (issue 18's first-generate target is a static cache's; a DynamicCache has none)
            + (f" (target <= 0.3 s: {'met' if first <= 0.3 else 'MISSED'})" if key != "dynamic"
               else "") + "; "
            f"tokens identical: {row[f'generate_{key}_tokens_identical']}; "
            f"{row[f'generate_{key}_captures']} captures and {row[f'generate_{key}_rebased']} "
            f"rebased graphs for its generates ({row[f'generate_{key}_build_s']:.3f} s "
            f"capturing and rebasing in all), {row.get(f'generate_{key}_set_ups', 0)} caches "
            "set up before their prefill")
        if f"generate_{key}_unchained_tokens_per_s" in row:
            text += (f"; its pieces not chained (each copies in and clones out): "
                     f"{row[f'generate_{key}_unchained_tokens_per_s']:.0f} tokens/s, tokens "
                     f"identical: {row[f'generate_{key}_unchained_tokens_identical']}")
        if f"generate_{key}_segments_tokens_per_s" in row:
            e_tps = row[f"generate_{key}_eager_tokens_per_s"]
            s_tps = row[f"generate_{key}_segments_tokens_per_s"]
            text += (f"\n    with segments=True (experimental): {s_tps:.0f} tokens/s "
                     f"({s_tps / e_tps:.2f}x eager), first generate "
                     f"{row[f'generate_{key}_segments_first_s']:.3f} s, tokens identical: "
                     f"{row[f'generate_{key}_segments_tokens_identical']}; "
                     f"{row[f'generate_{key}_segments']} segments graphed, "
                     f"{row[f'generate_{key}_segment_replays']} replays")
            text += "".join(f"\n      {line}" for line in
                            row[f"generate_{key}_segments_plan"][:4])
    for key, label in (("static", 'cache_implementation="static"'),
                       ("dynamic", "no cache option")):
        if f"sliding_{key}_speedup" not in row:
            continue
        text += (
            f"\n  Mistral (sliding window {row['sliding_window']}) model.generate(), {label}: "
            f"eager {row[f'sliding_{key}_eager_tokens_per_s']:.0f} tokens/s, graphify(model) "
            f"{row[f'sliding_{key}_graphify_tokens_per_s']:.0f} tokens/s, "
            f"{row[f'sliding_{key}_speedup']:.2f}x; first graphified generate "
            f"{row[f'sliding_{key}_first_s']:.3f} s; tokens identical: "
            f"{row[f'sliding_{key}_tokens_identical']}; {row[f'sliding_{key}_captures']} "
            f"captures, {row[f'sliding_{key}_replays']} replays, "
            f"{row[f'sliding_{key}_side_effects']} probed calls that showed the cache's side "
            "effect")
    if "generate_captures" in row:
        text += (f"\n  generate, all forms: captures {row['generate_captures']}, replays "
                 f"{row['generate_replays']}, evictions {row['generate_evictions']}")
        for why in row.get("generate_not_rebased", ()):
            text += f"\n  {why}"
    return text
