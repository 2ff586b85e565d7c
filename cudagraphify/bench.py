"""Benchmark: eager vs ``graphify`` vs what users would use instead, in one process and run.

    python -m cudagraphify.bench [--workloads A B C] [--columns ...] [--decode] [--quick]
                                 [--json out.json] [--chart out.png]

Columns (GPT workloads, inference): eager; a manual whole-model ``torch.cuda.CUDAGraph`` (the
floor); ``graphify`` (with and without output copies); per-block ``graphify`` (alone, in a
``graph_region``, and through ``share_graph``); ``torch.cuda.make_graphed_callables``;
``torch.compile(mode="reduce-overhead")``; ``thunder.jit`` with Thunder's CUDAGraphTransform (when
Thunder imports). For each: the median µs per call over repeated timed loops, ratios to eager and
to the floor, the time to the first graphed call, the extra peak memory of building and first
calls, and the max abs error against eager. ``--decode`` adds greedy decode of an HF
transformers Llama with a static KV cache (tokens/s, eager vs a graphed decode step). On a machine
without a GPU it says so and times the eager parts on the CPU only.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
import warnings
from typing import Callable

import torch

from ._models import GPT, WORKLOADS, GPTConfig

__all__ = ["main", "time_per_call"]

# "T" is one tiny block: GPU time is negligible, so it shows the Python cost of the replay path.
BENCH_WORKLOADS = {**WORKLOADS, "T": GPTConfig(64, 2, 1, 1, 4, torch.float32)}

# --columns name -> (row key prefix, heading). Eager and the manual graph (the floor) always run.
COLUMNS = {
    "graphify": ("graphify", "graphify"),
    "nocopy": ("graphify_nocopy", "graphify(copy_outputs=False)"),
    "layers": ("per_layer", "per-block graphify"),
    "region": ("per_layer_region", "per-block, in graph_region"),
    "share": ("share_graph", "share_graph(blocks)"),
    "mgc": ("make_graphed_callables", "make_graphed_callables"),
    "compile": ("torch_compile", "torch.compile reduce-overhead"),
    "thunder": ("thunder", "thunder.jit + CUDAGraphTransform"),
}
ALWAYS = (("eager", "eager"), ("manual_graph", "manual graph (floor)"))
# torch.compile takes 20-60 s per workload, thunder.jit up to a minute: --quick compiles these
QUICK_COMPILE_WORKLOADS = ("A",)


def time_per_call(fn, x, calls: int, repeats: int, sync=None) -> float:
    """Median µs per call of ``fn(x)`` over ``repeats`` loops of ``calls`` calls."""
    sync = sync or torch.cuda.synchronize
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        sync()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def _manual_graph(model, x):
    """The floor: one hand-made CUDAGraph of the whole model (copy in, replay, no copy out)."""
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = model(static_x)

    def run(inp):
        static_x.copy_(inp)
        g.replay()
        return static_y

    run.graph = g  # keeps the graph alive with the callable
    return run


def _error_text(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _free_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _measure(row: dict, label: str, model: torch.nn.Module, build: Callable, x, ref,
             calls: int, repeats: int, first_calls: int = 2, first_call_key: str | None = None,
             err: bool = True) -> None:
    """Time one column into ``row`` under keys ``{label}_*``; a failure is recorded, not raised.

    ``build(model)`` returns ``(fn, finish)``: the callable to time, and a function that records
    extra counters into the row and frees what the column holds. Building and the first
    ``first_calls`` calls make up ``{label}_first_call_s`` (the time to the first call that runs
    the graph) and ``{label}_peak_mb`` (peak memory above what was allocated before, MB);
    ``first_call_key`` also records building and the very first call alone (compilation).
    """
    fn = finish = None
    try:
        _free_memory()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn, finish = build(model)
        for i in range(first_calls):
            fn(x)
            if i == 0 and first_call_key:
                torch.cuda.synchronize()
                row[first_call_key] = time.perf_counter() - t0
        torch.cuda.synchronize()
        if label != "eager":
            row[f"{label}_first_call_s"] = time.perf_counter() - t0
        row[f"{label}_peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        row[f"{label}_us"] = time_per_call(fn, x, calls, repeats)
        if err:
            row[f"{label}_max_abs_err"] = (fn(x).float() - ref.float()).abs().max().item()
    except Exception as e:  # a column that fails says why in the row; the others still run
        row[f"{label}_error"] = _error_text(e)
        _progress(f"{row['workload']}: {label} failed: {row[f'{label}_error']}")
    finally:
        if finish is not None:
            try:
                finish(row)
            except Exception as e:
                row.setdefault(f"{label}_error", f"while releasing: {_error_text(e)}")
        fn = finish = model = None  # noqa: F841 - the column's graphs go with them
        _free_memory()


def _thunder_missing() -> str | None:
    """None when thunder.jit and its CUDAGraphTransform import; else why not."""
    from . import _tags

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if _tags.thunder() is None:  # imports it as cudagraphify does (torch >= 2.13 shims)
                return f"not importable ({_tags._thunder_error})"
            from thunder.transforms.cudagraph import CUDAGraphTransform  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError
        return f"not importable ({_error_text(e, 160)})"
    return None


def _builders(x) -> dict[str, tuple[Callable, int, str | None]]:
    """label -> (build(model) -> (fn, finish), first calls until a graph runs, compile key)."""
    import cudagraphify as cg

    def graphify(copy_outputs):
        def build(m):
            cg.graphify(m, copy_outputs=copy_outputs)
            label = "graphify" if copy_outputs else "graphify_nocopy"

            def finish(row):
                s = cg.stats(m)
                row[f"{label}_captures"], row[f"{label}_replays"] = s.captures, s.replays
                row[f"{label}_pool_mb"] = s.graph_pool_bytes / 2**20
                cg.ungraphify(m)
            return m, finish
        return build

    def per_layer(region: bool):
        def build(m):
            for blk in m.blocks:
                cg.graphify(blk)
            scope = cg.graph_region() if region else None
            if scope is not None:
                scope.__enter__()

            def finish(row):
                if scope is not None:
                    row["per_layer_region_input_copies"] = scope.stats().input_copies
                    scope.__exit__(None, None, None)
                for blk in m.blocks:
                    cg.ungraphify(blk)
            return m, finish
        return build

    def share(m):
        group = cg.share_graph(m.blocks)

        def finish(row):
            gs = group.stats()
            row["share_graph_captures"], row["share_graph_retargets"] = (gs["captures"],
                                                                         gs["retargets"])
            row["share_graph_per_layer"] = gs["per_layer"]
            row["share_graph_reasons"] = gs["reasons"]
            group.unshare()
        return m, finish

    def mgc(m):
        # a sample input of its own: calls with x then copy it in, as the other columns do
        return torch.cuda.make_graphed_callables(m, (x.clone(),)), lambda row: None

    def compile_(m):
        import torch._dynamo

        torch._dynamo.reset()
        compiled = torch.compile(m, mode="reduce-overhead")

        def run(inp):
            torch.compiler.cudagraph_mark_step_begin()  # a new inference step each call
            return compiled(inp)

        def finish(row):
            torch._dynamo.reset()
            try:
                from torch._inductor import cudagraph_trees

                cudagraph_trees.reset_cudagraph_trees()
            except Exception:  # noqa: BLE001, S110 - older or newer torch: dynamo's reset did it
                pass
        return run, finish

    def thunder_(m):
        import thunder
        from thunder.transforms.cudagraph import CUDAGraphTransform

        return thunder.jit(m, transforms=[CUDAGraphTransform()]), lambda row: None

    return {
        "graphify": (graphify(True), 2, None),
        "graphify_nocopy": (graphify(False), 2, None),
        "per_layer": (per_layer(False), 2, None),
        "per_layer_region": (per_layer(True), 2, None),
        "share_graph": (share, 2, None),
        "make_graphed_callables": (mgc, 1, None),
        "torch_compile": (compile_, 3, "torch_compile_compile_s"),
        "thunder": (thunder_, 3, "thunder_compile_s"),
    }


def bench_workload(name: str, cfg: GPTConfig, calls: int, repeats: int,
                   columns: list[str] | None = None, quick: bool = False,
                   device: str = "cuda") -> dict:
    """One GPT workload (inference, ``torch.no_grad()``) through each column (``COLUMNS``
    names; default: all). Row keys: ``{prefix}_us``, ``_vs_eager``, ``_vs_manual``,
    ``_first_call_s``, ``_peak_mb``, ``_max_abs_err``, or ``_error`` / ``_skipped``."""
    torch.manual_seed(0)
    model = GPT.from_config(cfg, device)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, device=device, dtype=cfg.dtype)
    row: dict = {"workload": name, "config": repr(cfg)}
    columns = list(COLUMNS) if columns is None else columns
    builders = _builders(x)
    with torch.no_grad():
        ref = model(x)
        _progress(f"{name}: eager")
        _measure(row, "eager", model, lambda m: (m, lambda row: None), x, ref, calls, repeats,
                 first_calls=1, err=False)
        _progress(f"{name}: capturing the manual whole-model graph")
        _measure(row, "manual_graph", model, lambda m: (_manual_graph(m, x), lambda row: None),
                 x, ref, calls, repeats, first_calls=1)
        for col in columns:
            label = COLUMNS[col][0]
            if col in ("compile", "thunder") and quick and name not in QUICK_COMPILE_WORKLOADS:
                row[f"{label}_skipped"] = ("--quick compiles workload "
                                           f"{'/'.join(QUICK_COMPILE_WORKLOADS)} only")
                continue
            if col == "thunder":
                missing = _thunder_missing()
                if missing:
                    row["thunder_skipped"] = missing
                    continue
            build, first_calls, first_call_key = builders[label]
            what = "compiling, first calls" if first_call_key else "building, first calls"
            _progress(f"{name}: {COLUMNS[col][1]} ({what})")
            _measure(row, label, copy.deepcopy(model), build, x, ref, calls, repeats,
                     first_calls=first_calls, first_call_key=first_call_key)
    add_ratios(row)
    return row


def add_ratios(row: dict) -> dict:
    """``{prefix}_vs_eager`` and ``{prefix}_vs_manual`` (µs over µs) for every timed column."""
    eager, manual = row.get("eager_us"), row.get("manual_graph_us")
    for prefix in ["eager", "manual_graph"] + [p for p, _ in COLUMNS.values()]:
        us = row.get(f"{prefix}_us")
        if us is None:
            continue
        if eager and prefix != "eager":
            row[f"{prefix}_vs_eager"] = us / eager
        if manual and prefix != "manual_graph":
            row[f"{prefix}_vs_manual"] = us / manual
    return row


def format_workload(row: dict, columns: list[str] | None = None) -> str:
    """The table of one workload row: one line per column (a reason where it did not run)."""
    columns = list(COLUMNS) if columns is None else columns
    lines = [f"{row['workload']}: {row.get('config', '')}",
             (f"  {'column':<33}{'µs/call':>9}{'/eager':>8}{'/manual':>8}{'1st call s':>11}"
              f"{'peak MB':>9}{'max abs err':>12}")]
    shown = list(ALWAYS) + [COLUMNS[c] for c in columns]
    for prefix, heading in shown:
        if f"{prefix}_us" not in row:
            why = (row.get(f"{prefix}_error") and f"error: {row[f'{prefix}_error']}"
                   or row.get(f"{prefix}_skipped") and f"skipped: {row[f'{prefix}_skipped']}"
                   or "not run")
            lines.append(f"  {heading:<33}{why}")
            continue

        def num(key, fmt):
            v = row.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"
        vs_eager = "1.000" if prefix == "eager" else num(f"{prefix}_vs_eager", "8.3f")
        vs_manual = "1.000" if prefix == "manual_graph" else num(f"{prefix}_vs_manual", "8.3f")
        line = (f"  {heading:<33}{num(f'{prefix}_us', '9.0f'):>9}{vs_eager:>8}{vs_manual:>8}"
                f"{num(f'{prefix}_first_call_s', '11.3f'):>11}{num(f'{prefix}_peak_mb', '9.1f'):>9}"
                f"{num(f'{prefix}_max_abs_err', '12.1e'):>12}")
        compile_key = {"torch_compile": "torch_compile_compile_s",
                       "thunder": "thunder_compile_s"}.get(prefix)
        if compile_key and compile_key in row:
            line += f"  (first call, compiling: {row[compile_key]:.1f} s)"
        if f"{prefix}_error" in row:
            line += f"  [{row[f'{prefix}_error']}]"
        lines.append(line)
    return "\n".join(lines)


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

    torch.manual_seed(0)
    base = GPT.from_config(cfg, "cuda").train()
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, device="cuda", dtype=cfg.dtype)
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
    _progress(f"{name}-train: graphify (forward and backward captures), then "
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
    import dataclasses

    import cudagraphify as cg

    rows = []
    for depth in depths:
        c = dataclasses.replace(cfg, layers=depth)
        torch.manual_seed(0)
        ref = GPT.from_config(c, "cuda")
        x = torch.randn(c.batch, c.seq, c.dim, device="cuda", dtype=c.dtype)
        row: dict = {"workload": f"{name}-share-L{depth}", "config": repr(c)}
        with torch.no_grad():
            want = ref(x)
            row["eager_us"] = time_per_call(ref, x, calls, repeats)
            for label in ("per_layer", "share_graph"):
                _progress(f"{name} L={depth}: {label}")
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
                    pool += gs["template_pool_bytes"]
                    row["share_graph_stats"] = gs
                    row["share_graph_capture_s"] = gs["capture_seconds"] + gs["build_seconds"]
                row[f"{label}_pool_mb"] = pool / 2**20
                del model
        row["share_vs_per_layer_us"] = row["share_graph_us"] / row["per_layer_us"]
        rows.append(row)
    return rows


def bench_sync(name: str, cfg: GPTConfig, sync: str, calls: int, repeats: int) -> dict:
    """A GPT with a host sync in every block: eager vs graphify (piecewise) vs graphify of the
    same GPT without the sync."""
    import cudagraphify as cg

    torch.manual_seed(0)
    model = GPT.from_config(cfg, "cuda", sync=sync)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, device="cuda", dtype=cfg.dtype)
    row: dict = {"workload": f"{name}-{sync}", "config": repr(cfg)}
    with torch.no_grad():
        ref = model(x)
        row["eager_us"] = time_per_call(model, x, calls, repeats)
        graphed = GPT.from_config(cfg, "cuda", sync=sync)
        graphed.load_state_dict(model.state_dict())
        cg.graphify(graphed)
        for _ in range(3):
            graphed(x)
        row["graphify_us"] = time_per_call(graphed, x, calls, repeats)
        row["graphify_max_abs_err"] = (graphed(x).float() - ref.float()).abs().max().item()
        row["explain"] = str(cg.explain(graphed))
        plain = GPT.from_config(cfg, "cuda")
        plain.load_state_dict(model.state_dict())
        cg.graphify(plain)
        plain(x), plain(x)
        row["graphify_without_sync_us"] = time_per_call(plain, x, calls, repeats)
    row["graphify_vs_eager"] = row["graphify_us"] / row["eager_us"]
    row["graphify_vs_graphify_without_sync"] = row["graphify_us"] / row["graphify_without_sync_us"]
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cudagraphify.bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="*", default=None, choices=sorted(BENCH_WORKLOADS),
                   help="GPT workloads to time (default: A B C; on a CPU: T A B; none: only "
                        "the other options' rows)")
    p.add_argument("--columns", nargs="+", default=None, choices=list(COLUMNS),
                   help="columns besides eager and the manual graph (default: all; torch.compile "
                        "takes 20-60 s per workload: with --quick, it and thunder run on "
                        "workload A only)")
    p.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    p.add_argument("--json", help="write the rows as JSON to this file")
    p.add_argument("--decode", action="store_true",
                   help="also time greedy decode of an HF Llama with a static KV cache "
                        "(needs transformers): eager vs a graphified decode step, tokens/s")
    p.add_argument("--decode-tokens", type=int, default=64, metavar="N",
                   help="new tokens per decode run (default 64)")
    p.add_argument("--decode-batch", type=int, default=1, metavar="B",
                   help="sequences decoded together (default 1)")
    p.add_argument("--sync", nargs="*", default=[], choices=["item", "nonzero"],
                   help="also time workload A with this host sync in every block")
    p.add_argument("--train", nargs="*", default=[], choices=sorted(WORKLOADS),
                   help="also time a training step (forward + .sum().backward()) of these")
    p.add_argument("--share", nargs="*", type=int, default=[], metavar="L",
                   help="also compare share_graph with per-layer graphs on workload A at these "
                        "depths (e.g. 12 24 48)")
    p.add_argument("--chart", metavar="PNG",
                   help="also draw µs per call of each workload and column (needs matplotlib)")
    args = p.parse_args(argv)
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the first token comes from the prefill)")
    return args


def main(argv: list[str] | None = None) -> int:
    from .bench_decode import DECODE_CPU_SIZES, bench_decode, format_decode

    args = parse_args(argv)
    calls, repeats = (20, 5) if args.quick else (100, 11)
    decode_repeats = 3 if args.quick else 7
    if not torch.cuda.is_available():
        print("cudagraphify.bench: no CUDA GPU here: graphs need one, so only the eager model is "
              "timed, on the CPU (graphify would run it eagerly too).")
        names = ["T", "A", "B"] if args.workloads is None else args.workloads
        rows = [bench_cpu(name, BENCH_WORKLOADS[name], calls, repeats) for name in names]
        if args.decode:
            r = bench_decode(args.decode_tokens, decode_repeats, args.decode_batch,
                             device="cpu", dtype=torch.float32, sizes=DECODE_CPU_SIZES)
            rows.append(r)
            print(format_decode(r), flush=True)
        _finish(rows, args, device="cpu")
        return 0
    names = ["A", "B", "C"] if args.workloads is None else args.workloads
    columns = list(COLUMNS) if args.columns is None else args.columns
    warnings.simplefilter("ignore")
    rows = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {calls} calls x "
          f"{repeats} repeats, median µs per call; peak MB: extra peak memory while building "
          f"and making the first calls; ratios: µs over eager's and over the manual graph's",
          flush=True)
    for name in names:
        r = bench_workload(name, BENCH_WORKLOADS[name], calls, repeats, columns, args.quick)
        rows.append(r)
        print(format_workload(r, columns), flush=True)
    if args.decode:
        r = bench_decode(args.decode_tokens, decode_repeats, args.decode_batch)
        rows.append(r)
        print(format_decode(r), flush=True)
    for sync in args.sync:
        r = bench_sync("A", WORKLOADS["A"], sync, calls, repeats)
        rows.append(r)
        print(f"A-{sync}: eager {r['eager_us']:.0f} µs, graphify (piecewise) "
              f"{r['graphify_us']:.0f} µs ({r['graphify_vs_eager']:.3f} of eager), graphify "
              f"without the sync {r['graphify_without_sync_us']:.0f} µs; max abs err "
              f"{r['graphify_max_abs_err']:.2e}\n{r['explain']}", flush=True)
    for name in args.train:
        r = bench_training(name, WORKLOADS[name], calls, repeats)
        rows.append(r)
        for mode in ("accumulate", "set_to_none"):
            print(f"{name}-train ({mode}): eager {r[f'eager_{mode}_us']:.0f} µs, graphify "
                  f"{r[f'graphify_{mode}_us']:.0f} µs, make_graphed_callables "
                  f"{r[f'make_graphed_callables_{mode}_us']:.0f} µs; graphify/mgc "
                  f"{r[f'graphify_vs_make_graphed_callables_{mode}']:.3f}; peak MB eager "
                  f"{r[f'eager_{mode}_peak_mb']:.0f} graphify {r[f'graphify_{mode}_peak_mb']:.0f} "
                  f"mgc {r[f'make_graphed_callables_{mode}_peak_mb']:.0f}", flush=True)
        print(f"{name}-train first call: graphify {r['graphify_first_call_s']:.3f} s (warm-up "
              f"{r['graphify_warmup_s']:.3f} s, capture {r['graphify_capture_s']:.3f} s), "
              f"make_graphed_callables {r['make_graphed_callables_first_call_s']:.3f} s",
              flush=True)
    if args.share:
        print("share_graph vs per-layer graphify (workload A blocks): first call s, capture s, "
              "µs per forward, pool MB")
    for r in bench_share("A", WORKLOADS["A"], args.share, calls, repeats) if args.share else []:
        rows.append(r)
        gs = r["share_graph_stats"]
        print(f"{r['workload']}: eager {r['eager_us']:.0f} µs | per-layer "
              f"{r['per_layer_first_call_s']:.3f} s, {r['per_layer_capture_s']:.3f} s, "
              f"{r['per_layer_us']:.0f} µs, {r['per_layer_pool_mb']:.1f} MB | share_graph "
              f"{r['share_graph_first_call_s']:.3f} s, {r['share_graph_capture_s']:.3f} s "
              f"(of it build {gs['build_seconds']:.3f} s), {r['share_graph_us']:.0f} µs, "
              f"{r['share_graph_pool_mb']:.1f} MB | share/per-layer "
              f"{r['share_vs_per_layer_us']:.3f}; captures {gs['captures']}, retargets "
              f"{gs['retargets']}, per-layer {gs['per_layer']} {gs['reasons'] or ''}; err "
              f"{r['share_graph_max_abs_err']:.1e}", flush=True)
    _finish(rows, args, device=torch.cuda.get_device_name())
    return 0


def bench_cpu(name: str, cfg: GPTConfig, calls: int, repeats: int) -> dict:
    """Eager µs per call of a workload on the CPU (what a machine without a GPU can tell)."""
    torch.manual_seed(0)
    model = GPT.from_config(cfg, "cpu")
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, dtype=cfg.dtype)
    _progress(f"{name}: timing the eager model on the CPU")
    with torch.no_grad():
        eager = time_per_call(model, x, calls, repeats, sync=lambda: None)
    print(f"{name:<9} eager {eager:>9.0f} µs per call on the CPU", flush=True)
    return {"workload": name, "config": repr(cfg), "device": "cpu", "eager_us": eager}


def _progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def _finish(rows: list, args, device: str) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": device, "rows": rows}, f, indent=1)
    if args.chart:
        print(draw_chart(rows, args.chart))


def draw_chart(rows: list, path: str) -> str:
    """A bar chart of µs per call per workload and column; returns what it did, in words."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib)"
    plotted = [r for r in rows if any(k.endswith("_us") for k in r)]
    columns = sorted({k for r in plotted for k, v in r.items()
                      if k.endswith("_us") and isinstance(v, (int, float))})
    if not plotted or not columns:
        return "no chart: no timed rows"
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(plotted) * len(columns) / 3), 4))
    width = 0.8 / len(columns)
    for j, col in enumerate(columns):
        xs = [i + j * width for i in range(len(plotted))]
        ax.bar(xs, [r.get(col, 0) for r in plotted], width, label=col[:-3])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(plotted))])
    ax.set_xticklabels([r["workload"] for r in plotted])
    ax.set_ylabel("µs per call (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart written to {path}"


if __name__ == "__main__":
    sys.exit(main())
