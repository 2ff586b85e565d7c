"""The benchmark's optional sections on workload A's GPT: a training step (``--train``),
``share_graph`` against per-layer graphs at several depths (``--share``; on HF Llama and GPT-2
layers with no option, ``--share-hf``), and a host sync in every block (``--sync``). Each returns
its row(s); ``format_*`` puts a row in words."""

from __future__ import annotations

import dataclasses
import time

import torch

from ._common import chaining, progress, segmenting, time_per_call
from .models import GPT, GPTConfig, model_and_input

__all__ = ["bench_training", "bench_share", "bench_share_hf", "bench_sync", "format_training",
           "format_share", "format_share_hf", "format_sync"]


def _peak_extra_mb(fn, x, steps: int = 3) -> float:
    """Peak memory above what was allocated before, over a few calls (MB)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        fn(x)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def bench_training(name: str, cfg: GPTConfig, calls: int, repeats: int) -> dict:
    """A training step (forward, ``.sum().backward()``): eager, graphify, make_graphed_callables.

    Two ways to treat gradients: ``accumulate`` (``.grad`` adds up over steps, as in gradient
    accumulation) and ``set_to_none`` (``zero_grad(set_to_none=True)`` before every step).
    """
    import cudagraphify as cg

    base, x = model_and_input(cfg, "cuda")
    base.train()
    row: dict = {"workload": f"{name}-train", "config": repr(cfg)}

    def step(fn, module, mode):
        params = list(module.parameters())

        def run(inp):
            if mode == "set_to_none":
                for p in params:
                    p.grad = None
            fn(inp).sum().backward()
        return run

    def fresh():
        m = GPT.from_config(cfg, "cuda").train()
        m.load_state_dict(base.state_dict())
        return m

    g = cg.graphify(fresh())
    progress(f"{name}-train: graphify (forward and backward captures), then "
              "make_graphed_callables")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(g, g, "accumulate")(x), step(g, g, "accumulate")(x)
    torch.cuda.synchronize()
    row["graphify_first_call_s"] = time.perf_counter() - t0
    mgc_model = fresh()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mgc = torch.cuda.make_graphed_callables(mgc_model, (x,))
    step(mgc, mgc_model, "accumulate")(x)
    torch.cuda.synchronize()
    row["make_graphed_callables_first_call_s"] = time.perf_counter() - t0
    for mode in ("accumulate", "set_to_none"):
        for label, fn, module in (("eager", base, base), ("graphify", g, g),
                                  ("make_graphed_callables", mgc, mgc_model)):
            run = step(fn, module, mode)
            row[f"{label}_{mode}_us"] = time_per_call(run, x, calls, repeats)
            row[f"{label}_{mode}_peak_mb"] = _peak_extra_mb(run, x)
        row[f"graphify_vs_eager_{mode}"] = row[f"graphify_{mode}_us"] / row[f"eager_{mode}_us"]
        row[f"graphify_vs_make_graphed_callables_{mode}"] = (
            row[f"graphify_{mode}_us"] / row[f"make_graphed_callables_{mode}_us"])
    s = cg.stats(g)
    row["graphify_captures"], row["graphify_replays"] = s.captures, s.replays
    row["graphify_eager_calls"] = s.eager
    row["graphify_warmup_s"], row["graphify_capture_s"] = s.warmup_seconds, s.capture_seconds
    return row


def bench_share(name: str, cfg: GPTConfig, depths: list[int], calls: int, repeats: int) -> list:
    """share_graph vs per-layer graphify over the blocks of a GPT of each depth: time to the
    first graphed forward, capture seconds, µs per forward, graph pool MB, error vs eager."""
    import cudagraphify as cg

    rows = []
    for depth in depths:
        c = dataclasses.replace(cfg, layers=depth)
        ref, x = model_and_input(c, "cuda")
        row: dict = {"workload": f"{name}-share-L{depth}", "config": repr(c)}
        with torch.no_grad():
            want = ref(x)
            row["eager_us"] = time_per_call(ref, x, calls, repeats)
            for label in ("per_layer", "share_graph"):
                progress(f"{name} L={depth}: {label}")
                model = GPT.from_config(c, "cuda")
                model.load_state_dict(ref.state_dict())
                if label == "share_graph":
                    group = cg.share_graph(model.blocks)
                else:
                    for blk in model.blocks:
                        cg.graphify(blk)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(x)  # warm-up + capture (or retarget) of every block
                torch.cuda.synchronize()
                row[f"{label}_first_call_s"] = time.perf_counter() - t0
                stats = [cg.stats(b) for b in model.blocks]
                row[f"{label}_capture_s"] = sum(st.capture_seconds for st in stats)
                row[f"{label}_us"] = time_per_call(model, x, calls, repeats)
                row[f"{label}_max_abs_err"] = (model(x).float() - want.float()).abs().max().item()
                pool = sum(st.graph_pool_bytes for st in stats)
                if label == "share_graph":
                    gs = group.stats()
                    pool += gs.template_pool_bytes
                    row["share_graph_stats"] = dataclasses.asdict(gs)
                    row["share_graph_capture_s"] = gs.capture_seconds + gs.build_seconds
                row[f"{label}_pool_mb"] = pool / 2**20
                del model
        row["share_vs_per_layer_us"] = row["share_graph_us"] / row["per_layer_us"]
        rows.append(row)
    return rows


# (architecture, layers) of --share-hf: HF Llama (hidden 512, bf16) at two depths (graph memory
# flat in depth?) and GPT-2 (n_embd 512, bf16)
SHARE_HF = (("llama", 8), ("llama", 16), ("gpt2", 12))


def _hf_model(arch: str, layers: int):
    """A random-weight HF model in bf16 on the GPU, its decoder layers, and its call's
    keywords (no cache: the same shapes on every call)."""
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376,
                                       num_hidden_layers=layers, num_attention_heads=8,
                                       num_key_value_heads=4, vocab_size=32000)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(n_embd=512, n_layer=layers, n_head=8, vocab_size=32000,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    model = model.to("cuda", torch.bfloat16).eval()
    layers_of = (lambda m: m.model.layers) if arch == "llama" else (lambda m: m.transformer.h)
    return model, layers_of


def bench_share_hf(calls: int, repeats: int, seq: int = 16) -> list:
    """``share_graph(layers)`` with no option against ``graphify`` of each layer, on HF models
    (:data:`SHARE_HF`): µs per forward (one prompt of ``seq`` tokens, no cache), graph pool MB,
    how many layer graphs were shared, and whether logits equal eager's bitwise."""
    import copy

    import cudagraphify as cg

    rows = []
    for arch, depth in SHARE_HF:
        row: dict = {"workload": f"hf-share-{arch}-L{depth}"}
        try:
            ref, layers_of = _hf_model(arch, depth)
        except Exception as e:  # noqa: BLE001 - transformers missing or broken: say so
            row["not_run"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            continue
        ids = torch.randint(0, 32000, (1, seq), device="cuda")

        def logits(m, x):
            return m(input_ids=x, use_cache=False).logits

        with torch.no_grad():
            want = logits(ref, ids)
            row["eager_us"] = time_per_call(lambda x: logits(ref, x), ids, calls, repeats)
            for label in ("per_layer", "share_graph"):
                progress(f"hf share {arch} L={depth}: {label}")
                model = copy.deepcopy(ref)
                layers = layers_of(model)
                group = cg.share_graph(layers) if label == "share_graph" else None
                if group is None:
                    for layer in layers:
                        cg.graphify(layer)
                for _ in range(3):
                    got = logits(model, ids)
                row[f"{label}_equal"] = bool(torch.equal(got, want))
                row[f"{label}_us"] = time_per_call(lambda x: logits(model, x), ids, calls,
                                                   repeats)
                stats = [cg.stats(layer) for layer in layers]
                pool = sum(st.graph_pool_bytes for st in stats)
                if group is not None:
                    gs = group.stats()
                    pool += gs.template_pool_bytes
                    row["shared"], row["per_layer"] = gs.retargets, gs.per_layer
                    row["reasons"] = list(gs.reasons)[:2]
                    row["unproven_slots"] = sum(dict(gs.unproven_slots).values())
                row[f"{label}_replays"] = sum(st.replays for st in stats)
                row[f"{label}_pool_mb"] = pool / 2**20
                model = layers = group = None  # (freed before the next one is built)
        row["share_vs_per_layer_us"] = row["share_graph_us"] / row["per_layer_us"]
        rows.append(row)
    return rows


def format_share_hf(r: dict) -> str:
    if "not_run" in r:
        return f"{r['workload']}: not run: {r['not_run']}"
    return (f"{r['workload']}: eager {r['eager_us']:.0f} µs | per-layer graphify "
            f"{r['per_layer_us']:.0f} µs, {r['per_layer_pool_mb']:.1f} MB, equal "
            f"{r['per_layer_equal']} | share_graph {r['share_graph_us']:.0f} µs, "
            f"{r['share_graph_pool_mb']:.1f} MB, equal {r['share_graph_equal']}, "
            f"{r['shared']} layer graphs shared, {r['per_layer']} per layer"
            f"{' ' + str(r['reasons']) if r['reasons'] else ''} | share/per-layer µs "
            f"{r['share_vs_per_layer_us']:.3f} (target <= 1.05)")


def bench_sync(name: str, cfg: GPTConfig, sync: str, calls: int, repeats: int) -> dict:
    """A GPT with a host sync in every block: eager vs graphify (piecewise, its pieces chained
    in the root's implicit region) vs the same with chaining off (each piece copies in and
    clones out) vs graphify of the same GPT without the sync. Eager and the two piecewise
    forms are timed in three interleaved rounds (each its best), in one process."""
    import cudagraphify as cg

    model, x = model_and_input(cfg, "cuda", sync)
    row: dict = {"workload": f"{name}-{sync}", "config": repr(cfg)}

    def graphify_copy():
        m = GPT.from_config(cfg, "cuda", sync=sync)
        m.load_state_dict(model.state_dict())
        cg.graphify(m)
        for _ in range(24):  # (the root's plan, its pieces' captures and timed first calls,
            # the plan's own trial)
            m(x)
        return m

    def unchained_call(inp):
        with chaining(False):
            return unchained(inp)

    def segments_call(inp):  # (segments are experimental: on only for this copy's calls)
        with segmenting():
            return segmented(inp)

    with torch.no_grad():
        ref = model(x)
        graphed = graphify_copy()
        with chaining(False):
            unchained = graphify_copy()
        with segmenting():
            segmented = graphify_copy()
        timed = {"eager_us": model, "graphify_us": graphed,
                 "graphify_unchained_us": unchained_call, "segments_us": segments_call}
        rounds: dict[str, list[float]] = {key: [] for key in timed}
        for _ in range(3):
            for key, fn in timed.items():
                rounds[key].append(time_per_call(fn, x, calls, repeats))
        for key, values in rounds.items():
            row[key] = min(values)
        row["rounds"] = rounds  # (each round's µs: a trend shows a plan still changing)
        # whether the root's eager runs still chain in their implicit region (a piece live)
        row["chain_live"] = graphed._cudagraphify_state._chain_needed()
        row["graphify_unchained_max_abs_err"] = (
            unchained_call(x).float() - ref.float()).abs().max().item()
        row["segments_bitwise"] = bool(torch.equal(segments_call(x), ref))
        seg_stats = cg.stats(segmented)
        row["segments"], row["segment_replays"] = seg_stats.segments, seg_stats.segment_replays
        row["segments_plan"] = [line for p in segmented._cudagraphify_state.segments.plans()
                                for line in p.describe()]
        states = [m.__dict__.get("_cudagraphify_state") for m in graphed.modules()
                  if m is not graphed]
        states = [st for st in states if st is not None]
        row["pieces"] = len(states)
        row["pieces_given_back"] = sum(st.given_back is not None for st in states)
        row["graphify_max_abs_err"] = (graphed(x).float() - ref.float()).abs().max().item()
        row["explain"] = str(cg.explain(graphed))
        plain = GPT.from_config(cfg, "cuda")
        plain.load_state_dict(model.state_dict())
        cg.graphify(plain)
        plain(x), plain(x)
        row["graphify_without_sync_us"] = time_per_call(plain, x, calls, repeats)
    row["graphify_vs_eager"] = row["graphify_us"] / row["eager_us"]
    row["graphify_unchained_vs_eager"] = row["graphify_unchained_us"] / row["eager_us"]
    row["segments_vs_eager"] = row["segments_us"] / row["eager_us"]
    row["graphify_vs_graphify_without_sync"] = row["graphify_us"] / row["graphify_without_sync_us"]
    return row


def format_sync(r: dict) -> str:
    return (f"{r['workload']}: eager {r['eager_us']:.0f} µs, graphify (piecewise: "
            f"{r['pieces']} pieces, {r['pieces_given_back']} given back as not paying) "
            f"{r['graphify_us']:.0f} µs ({r['graphify_vs_eager']:.3f} of eager), its pieces not "
            f"chained {r['graphify_unchained_us']:.0f} µs ({r['graphify_unchained_vs_eager']:.3f}"
            f" of eager; max abs err {r['graphify_unchained_max_abs_err']:.2e}), graphify "
            f"without the sync {r['graphify_without_sync_us']:.0f} µs; max abs err "
            f"{r['graphify_max_abs_err']:.2e}\n  segments (experimental): {r['segments_us']:.0f}"
            f" µs ({r['segments_vs_eager']:.3f} of eager), {r['segments']} graphed, "
            f"{r['segment_replays']} replays, bitwise equal to eager: {r['segments_bitwise']}\n"
            + "\n".join("    " + line for line in r["segments_plan"][:6])
            + "\n  rounds (µs): " + "; ".join(
                f"{k.removesuffix('_us')} " + " ".join(f"{v:.0f}" for v in vs)
                for k, vs in r.get("rounds", {}).items())
            + f"; root still chaining: {r.get('chain_live')}"
            + f"\n{r['explain']}")


def format_training(r: dict) -> str:
    name = r["workload"]
    lines = [f"{name} ({mode}): eager {r[f'eager_{mode}_us']:.0f} µs, graphify "
             f"{r[f'graphify_{mode}_us']:.0f} µs, make_graphed_callables "
             f"{r[f'make_graphed_callables_{mode}_us']:.0f} µs; graphify/mgc "
             f"{r[f'graphify_vs_make_graphed_callables_{mode}']:.3f}; peak MB eager "
             f"{r[f'eager_{mode}_peak_mb']:.0f} graphify {r[f'graphify_{mode}_peak_mb']:.0f} "
             f"mgc {r[f'make_graphed_callables_{mode}_peak_mb']:.0f}"
             for mode in ("accumulate", "set_to_none")]
    lines.append(f"{name} first call: graphify {r['graphify_first_call_s']:.3f} s (warm-up "
                 f"{r['graphify_warmup_s']:.3f} s, capture {r['graphify_capture_s']:.3f} s), "
                 f"make_graphed_callables {r['make_graphed_callables_first_call_s']:.3f} s")
    return "\n".join(lines)


SHARE_HEADING = ("share_graph vs per-layer graphify (workload A blocks): first call s, capture s, "
                 "µs per forward, pool MB")


def format_share(r: dict) -> str:
    gs = r["share_graph_stats"]
    return (f"{r['workload']}: eager {r['eager_us']:.0f} µs | per-layer "
            f"{r['per_layer_first_call_s']:.3f} s, {r['per_layer_capture_s']:.3f} s, "
            f"{r['per_layer_us']:.0f} µs, {r['per_layer_pool_mb']:.1f} MB | share_graph "
            f"{r['share_graph_first_call_s']:.3f} s, {r['share_graph_capture_s']:.3f} s "
            f"(of it build {gs['build_seconds']:.3f} s), {r['share_graph_us']:.0f} µs, "
            f"{r['share_graph_pool_mb']:.1f} MB | share/per-layer "
            f"{r['share_vs_per_layer_us']:.3f}; captures {gs['captures']}, retargets "
            f"{gs['retargets']}, per-layer {gs['per_layer']} {gs['reasons'] or ''}; err "
            f"{r['share_graph_max_abs_err']:.1e}")
