"""Benchmark: eager vs ``graphify`` vs a manual whole-model CUDA graph, in one process and run.

    python -m cudagraphify.bench [--workloads A B C] [--quick] [--json out.json] [--chart out.png]

Reports the median µs per call over repeated timed loops, ratios to eager and to the manual
graph (the floor), time to the first graphed call, and the max abs error against eager. On a
machine without a GPU it says so and times the eager model on the CPU only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch

from ._models import GPT, WORKLOADS, GPTConfig

__all__ = ["main", "time_per_call"]

# "T" is one tiny block: GPU time is negligible, so it shows the Python cost of the replay path.
BENCH_WORKLOADS = {**WORKLOADS, "T": GPTConfig(64, 2, 1, 1, 4, torch.float32)}


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

    return run


def bench_workload(name: str, cfg: GPTConfig, calls: int, repeats: int) -> dict:
    import cudagraphify as cg

    torch.manual_seed(0)
    model = GPT.from_config(cfg, "cuda")
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, device="cuda", dtype=cfg.dtype)
    row: dict = {"workload": name, "config": repr(cfg)}
    with torch.no_grad():
        ref = model(x)
        _progress(f"{name}: eager")
        row["eager_us"] = time_per_call(model, x, calls, repeats)
        _progress(f"{name}: capturing the manual whole-model graph")
        manual = _manual_graph(model, x)
        row["manual_graph_us"] = time_per_call(manual, x, calls, repeats)

        for label, copy_outputs in (("graphify", True), ("graphify_nocopy", False)):
            graphed = GPT.from_config(cfg, "cuda")
            graphed.load_state_dict(model.state_dict())
            cg.graphify(graphed, copy_outputs=copy_outputs)
            _progress(f"{name}: {label} (warm-up and capture on the first call)")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphed(x)  # warm-up (eager, the real first call) + capture
            graphed(x)  # first replay
            torch.cuda.synchronize()
            row[f"{label}_first_call_s"] = time.perf_counter() - t0
            row[f"{label}_us"] = time_per_call(graphed, x, calls, repeats)
            row[f"{label}_max_abs_err"] = (graphed(x).float() - ref.float()).abs().max().item()
            s = cg.stats(graphed)
            row[f"{label}_captures"], row[f"{label}_replays"] = s.captures, s.replays
            row[f"{label}_pool_mb"] = s.graph_pool_bytes / 2**20
            cg.ungraphify(graphed)
            del graphed
        _progress(f"{name}: per-block graphs, then per-block graphs in a graph_region")
        # per-layer graphs: each block graphified, outside a region and in a chaining region
        layered = GPT.from_config(cfg, "cuda")
        layered.load_state_dict(model.state_dict())
        for blk in layered.blocks:
            cg.graphify(blk)
        layered(x), layered(x)
        row["per_layer_us"] = time_per_call(layered, x, calls, repeats)
        with cg.graph_region() as region:
            layered(x), layered(x)
            row["per_layer_region_us"] = time_per_call(layered, x, calls, repeats)
            row["per_layer_region_input_copies"] = region.stats().input_copies
            row["per_layer_region_max_abs_err"] = (layered(x).float() - ref.float()).abs().max().item()
        del layered
    for col in ("manual_graph_us", "graphify_us", "graphify_nocopy_us", "per_layer_us",
                "per_layer_region_us"):
        row[col.replace("_us", "_vs_eager")] = row[col] / row["eager_us"]
    row["graphify_vs_manual"] = row["graphify_us"] / row["manual_graph_us"]
    row["graphify_nocopy_vs_manual"] = row["graphify_nocopy_us"] / row["manual_graph_us"]
    return row


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cudagraphify.bench", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=None, choices=sorted(BENCH_WORKLOADS),
                   help="GPT workloads to time (default: A B C; on a CPU: T A B)")
    p.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    p.add_argument("--json", help="write the rows as JSON to this file")
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
    calls, repeats = (20, 5) if args.quick else (100, 11)
    if not torch.cuda.is_available():
        print("cudagraphify.bench: no CUDA GPU here: graphs need one, so only the eager model is "
              "timed, on the CPU (graphify would run it eagerly too).")
        rows = [bench_cpu(name, BENCH_WORKLOADS[name], calls, repeats)
                for name in (args.workloads or ["T", "A", "B"])]
        _finish(rows, args, device="cpu")
        return 0
    args.workloads = args.workloads or ["A", "B", "C"]
    warnings.simplefilter("ignore")
    rows = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"{calls} calls x {repeats} repeats, median µs per call")
    header = ("workload", "eager", "manual", "graphify", "nocopy", "layers", "region",
              "g/manual", "g/eager", "first call s")
    print("{:<9}{:>9}{:>9}{:>9}{:>9}{:>9}{:>9}{:>10}{:>9}{:>14}".format(*header))
    for name in args.workloads:
        r = bench_workload(name, BENCH_WORKLOADS[name], calls, repeats)
        rows.append(r)
        print(f"{name:<9}{r['eager_us']:>9.0f}{r['manual_graph_us']:>9.0f}{r['graphify_us']:>9.0f}"
              f"{r['graphify_nocopy_us']:>9.0f}{r['per_layer_us']:>9.0f}"
              f"{r['per_layer_region_us']:>9.0f}{r['graphify_vs_manual']:>10.3f}"
              f"{r['graphify_vs_eager']:>9.3f}{r['graphify_first_call_s']:>14.3f}", flush=True)
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
