"""The GPT workloads' inference columns: eager vs ``graphify`` vs what users would use instead.

Columns: eager; a manual whole-model ``torch.cuda.CUDAGraph`` (the floor); ``graphify`` (with and
without output copies); per-block ``graphify`` (alone, in a ``graph_region``, and through
``share_graph``); ``torch.cuda.make_graphed_callables``; ``torch.compile(mode="reduce-overhead")``;
``thunder.jit`` with Thunder's CUDAGraphTransform (when Thunder imports). For each: the median
µs per call over repeated timed loops, ratios to eager and to the floor, the time to the first
graphed call, the extra peak memory of building and first calls, and the max abs error against
eager. On a CPU, :func:`bench_cpu` times the eager model only.
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Callable

import torch

from ._common import error_text, free_memory, hand_capture, progress, time_per_call
from .models import WORKLOADS, GPTConfig, model_and_input

__all__ = ["BENCH_WORKLOADS", "COLUMNS", "ALWAYS", "bench_workload", "add_ratios",
           "format_workload", "bench_cpu"]

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


def _manual_graph(model, x):
    """The floor: one hand-made CUDAGraph of the whole model (copy in, replay, no copy out)."""
    g, static_x, static_y = hand_capture(model, x)

    def run(inp):
        static_x.copy_(inp)
        g.replay()
        return static_y

    run.graph = g  # keeps the graph alive with the callable
    return run


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
        free_memory()
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
        row[f"{label}_error"] = error_text(e)
        progress(f"{row['workload']}: {label} failed: {row[f'{label}_error']}")
    finally:
        if finish is not None:
            try:
                finish(row)
            except Exception as e:
                row.setdefault(f"{label}_error", f"while releasing: {error_text(e)}")
        fn = finish = model = None  # noqa: F841 - the column's graphs go with them
        free_memory()


def _thunder_missing() -> str | None:
    """None when thunder.jit and its CUDAGraphTransform import; else why not."""
    from .. import _tags

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if _tags.thunder() is None:  # imports it as cudagraphify does (torch >= 2.13 shims)
                return f"not importable ({_tags._thunder_error})"
            from thunder.transforms.cudagraph import CUDAGraphTransform  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError
        return f"not importable ({error_text(e, 160)})"
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
            row["share_graph_captures"], row["share_graph_retargets"] = gs.captures, gs.retargets
            row["share_graph_per_layer"] = gs.per_layer
            row["share_graph_reasons"] = gs.reasons
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
    model, x = model_and_input(cfg, device)
    row: dict = {"workload": name, "config": repr(cfg)}
    columns = list(COLUMNS) if columns is None else columns
    builders = _builders(x)
    with torch.no_grad():
        ref = model(x)
        progress(f"{name}: eager")
        _measure(row, "eager", model, lambda m: (m, lambda row: None), x, ref, calls, repeats,
                 first_calls=1, err=False)
        progress(f"{name}: capturing the manual whole-model graph")
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
            progress(f"{name}: {COLUMNS[col][1]} ({what})")
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


def bench_cpu(name: str, cfg: GPTConfig, calls: int, repeats: int) -> dict:
    """Eager µs per call of a workload on the CPU (what a machine without a GPU can tell)."""
    model, x = model_and_input(cfg, "cpu")
    progress(f"{name}: timing the eager model on the CPU")
    with torch.no_grad():
        eager = time_per_call(model, x, calls, repeats, sync=lambda: None)
    print(f"{name:<9} eager {eager:>9.0f} µs per call on the CPU", flush=True)
    return {"workload": name, "config": repr(cfg), "device": "cpu", "eager_us": eager}
