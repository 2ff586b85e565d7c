"""The benchmark: eager vs ``graphify`` vs what users would use instead, in one process and run.

    python -m cudagraphify.bench [--workloads A B C] [--columns ...] [--decode] [--quick]
                                 [--train A] [--share 12 24 48] [--share-hf] [--sync item]
                                 [--overhead] [--serve] [--differential] [--json out.json]
                                 [--chart out.png]
    python -m cudagraphify.bench.compose [--quick] [--json compose.json]

The sections, one module each:

- :mod:`.workloads`: the GPT workloads' inference columns (eager, a manual whole-model graph,
  ``graphify``, per-block, ``share_graph``, ``make_graphed_callables``, ``torch.compile``,
  Thunder); on a CPU, the eager model only.
- :mod:`.decode`: ``--decode``, greedy decode of an HF transformers Llama with a static cache.
- :mod:`.sections`: ``--train``, ``--share``, ``--share-hf``, ``--sync``.
- :mod:`.overhead`: ``--overhead``, the call path's cost in µs per call against the targets.
- :mod:`.serve`: ``--serve``, many input sizes of one model (graph memory, capture time).
- :mod:`.differential`: ``--differential``, the differential suite's models, every step of its
  script timed against eager.
- :mod:`.compose`: FSDP2, DDP, torch.compile, checkpointing and Thunder with and without
  cudagraphify (its own command).
- :mod:`.models`: the reference GPT the benchmark and the tests use; :mod:`._common`: timing.

Progress goes to stderr, rows to stdout; ``--json`` and ``--chart`` write them down.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings

import torch

from .decode import DECODE_CPU_SIZES, bench_decode, format_decode
from .models import WORKLOADS
from .differential import bench_differential, format_differential
from .overhead import bench_overhead, format_overhead
from .serve import bench_serve, format_serve
from .sections import (SHARE_HEADING, bench_share, bench_share_hf, bench_sync, bench_training,
                       format_share, format_share_hf, format_sync, format_training)
from .workloads import BENCH_WORKLOADS, COLUMNS, bench_cpu, bench_workload, format_workload

__all__ = ["main", "parse_args", "draw_chart"]


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
    p.add_argument("--sync", nargs="*", default=[], choices=["item", "nonzero", "item-inline"],
                   help="also time workload A with this host sync in every block "
                        "(item-inline: an .item() block that computes attention and MLP "
                        "inline, its children one-kernel Linear and LayerNorm layers)")
    p.add_argument("--train", nargs="*", default=[], choices=sorted(WORKLOADS),
                   help="also time a training step (forward + .sum().backward()) of these")
    p.add_argument("--share", nargs="*", type=int, default=[], metavar="L",
                   help="also compare share_graph with per-layer graphs on workload A at these "
                        "depths (e.g. 12 24 48)")
    p.add_argument("--share-hf", action="store_true",
                   help="also compare share_graph (no option) with per-layer graphify on HF "
                        "Llama (8 and 16 layers) and GPT-2 (12) layers, bf16; alone (no "
                        "--workloads), only this section")
    p.add_argument("--serve", action="store_true",
                   help="many input sizes of one model: graph memory of workload A at 8 batch "
                        "sizes (by hand, capture_sizes, on demand) and the time to capture 32 "
                        "sizes of a 16-layer HF Llama decode forward; alone (no --workloads), only "
                        "this section")
    p.add_argument("--overhead", action="store_true",
                   help="also time the call path's overhead in µs per call (a Linear(64, 64); "
                        "hand-made graph, graphify, eager-decided calls, an HF Llama decode "
                        "step) against the targets; alone (no --workloads), only this section")
    p.add_argument("--differential", action="store_true",
                   help="also time the differential suite's models step by step (HF GPT-2, "
                        "Llama, BERT, ResNet-18, our GPT): graphify against eager in every step "
                        "of its script; alone (no --workloads), only this section")
    p.add_argument("--chart", metavar="PNG",
                   help="also draw µs per call of each workload and column (needs matplotlib)")
    args = p.parse_args(argv)
    if args.chart and importlib.util.find_spec("matplotlib") is None:
        p.error("--chart needs matplotlib: pip install matplotlib (or leave --chart out)")
    if (args.overhead or args.serve or args.share_hf or args.differential) \
            and args.workloads is None:
        args.workloads = []
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the first token comes from the prefill)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    calls, repeats = (20, 5) if args.quick else (100, 11)
    decode_repeats = 3 if args.quick else 7
    if not torch.cuda.is_available():
        rows = _on_cpu(args, calls, repeats, decode_repeats)
        return _finish(rows, args, device="cpu")
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
    if args.overhead:
        r = bench_overhead(*((200, 5) if args.quick else (1000, 31)),
                           decode_repeats=decode_repeats)
        rows.append(r)
        print(format_overhead(r), flush=True)
    for r in bench_differential() if args.differential else []:
        rows.append(r)
        print(format_differential(r), flush=True)
    for r in bench_serve() if args.serve else []:
        rows.append(r)
        print(format_serve(r), flush=True)
    for sync in args.sync:
        r = bench_sync("A", WORKLOADS["A"], sync, calls, repeats)
        rows.append(r)
        print(format_sync(r), flush=True)
    for name in args.train:
        r = bench_training(name, WORKLOADS[name], calls, repeats)
        rows.append(r)
        print(format_training(r), flush=True)
    if args.share:
        print(SHARE_HEADING)
    for r in bench_share("A", WORKLOADS["A"], args.share, calls, repeats) if args.share else []:
        rows.append(r)
        print(format_share(r), flush=True)
    for r in bench_share_hf(calls, repeats) if args.share_hf else []:
        rows.append(r)
        print(format_share_hf(r), flush=True)
    return _finish(rows, args, device=torch.cuda.get_device_name())


# What each GPU-only section would have measured, for its line on a CPU.
_GPU_ONLY = {
    "overhead": "it times graph replays against eager",
    "train": "a training step through forward and backward graphs",
    "share": "share_graph builds each layer's graph from a captured template",
    "share-hf": "share_graph on HF layers, against per-layer graphs",
    "sync": "graphify's piecewise plan around a host sync, against eager",
    "serve": "graph memory and capture time of many input sizes",
    "differential": "graphify against eager in every step of the differential script",
}


def _on_cpu(args, calls: int, repeats: int, decode_repeats: int) -> list[dict]:
    """The rows a machine without a GPU can give: eager on the CPU, and a line for each
    section that needs a GPU."""
    print("cudagraphify.bench: no CUDA GPU here: graphs need one, so only the eager model is "
          "timed, on the CPU (graphify would run it eagerly too).")
    names = ["T", "A", "B"] if args.workloads is None else args.workloads
    rows = [bench_cpu(name, BENCH_WORKLOADS[name], calls, repeats) for name in names]
    if args.decode:
        rows.append(bench_decode(args.decode_tokens, decode_repeats, args.decode_batch,
                                 device="cpu", dtype=torch.float32, sizes=DECODE_CPU_SIZES))
        print(format_decode(rows[-1]), flush=True)
    skipped = ([("overhead", "overhead")] * args.overhead
               + [("serve", "serve")] * args.serve
               + [("differential", "differential")] * args.differential
               + [(f"{name}-train", "train") for name in args.train]
               + [(f"A-share-L{depth}", "share") for depth in args.share]
               + [("hf-share", "share-hf")] * args.share_hf
               + [(f"A-{sync}", "sync") for sync in args.sync])
    for workload, section in skipped:
        rows.append({"workload": workload,
                     "not_run": f"needs a CUDA GPU ({_GPU_ONLY[section]})"})
        print(f"{workload}: not run: {rows[-1]['not_run']}", flush=True)
    return rows


def _finish(rows: list, args, device: str) -> int:
    """Write the rows down (``--json``, ``--chart``); the exit status (1: no chart written)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": device, "rows": rows}, f, indent=1)
    if args.chart:
        done = draw_chart(rows, args.chart)
        if not done.startswith("chart written"):
            print(f"cudagraphify.bench: {done}", file=sys.stderr)
            return 1
        print(done)
    return 0


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
