"""The serving rows of the benchmark (``--serve``): many input sizes of one model.

- ``A-sizes``: workload A's GPT at 8 batch sizes (1-16). Graph memory (the segments of graph
  memory pools, after ``empty_cache``) of: graphs captured by hand largest first into one
  pool (the floor), every size through ``capture_sizes`` (largest first), and every size
  captured on demand by ``graphify``, smallest first. Outputs are compared with eager, bitwise.
- ``A-buckets``: workload A at every batch size 1-16 through ``bucketed`` over 4 bucket
  graphs, against a graph per size and eager: mean µs per call, graph memory, the largest
  difference from eager.
- ``llama-sizes``: an HF Llama (16 layers, hidden 512, bf16; random weights) decode-shaped
  forward (``input_ids`` of shape (B, 1), no cache) at 32 batch sizes through
  ``capture_sizes``: seconds (warm-up and capture), memory.
"""

from __future__ import annotations

import copy

import torch

from ._common import error_text, free_memory, progress
from .models import WORKLOADS, model_and_input

__all__ = ["bench_serve", "format_serve", "A_SIZES", "LLAMA_SIZES"]

A_SIZES = [1, 2, 3, 4, 6, 8, 12, 16]
LLAMA_SIZES = list(range(1, 33))
LLAMA = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=16,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)


def _pools_bytes() -> int:
    """Bytes reserved by graph memory pools (not the default pool), after freeing what can be
    freed: the graphs' memory alone, whatever eager calls left cached."""
    free_memory()
    return sum(s["total_size"] for s in torch.cuda.memory._snapshot()["segments"]
               if tuple(s["segment_pool_id"]) != (0, 0))


def _reserved_mb(before: int) -> float:
    return (_pools_bytes() - before) / 2**20


def _hand_pool_mb(model, inputs: dict) -> float:
    """Graphs of every size captured by hand into one pool, largest first (MB reserved)."""
    before = _pools_bytes()
    graphs, pool = [], None
    side = torch.cuda.Stream()
    for b in sorted(inputs, reverse=True):
        x = inputs[b].clone()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            y = model(x)
        pool = g.pool() if pool is None else pool
        graphs.append((g, x, y))
    mb = _reserved_mb(before)
    del graphs
    free_memory()
    return mb


def _graphify_mb(base, inputs: dict, up_front: bool) -> tuple[float, float, bool]:
    """(MB reserved, seconds, outputs equal to eager) for graphify with every size captured
    up front (``capture_sizes``) or on demand, smallest first."""
    import time

    import cudagraphify as cg

    model = cg.graphify(copy.deepcopy(base))
    before = _pools_bytes()
    t0 = time.perf_counter()
    if up_front:
        done = cg.capture_sizes(model, lambda b: (inputs[b],), list(inputs), progress=False)
        assert not done.eager, done
    else:
        for b in sorted(inputs):
            model(inputs[b])
            model(inputs[b])
    seconds = time.perf_counter() - t0
    mb = _reserved_mb(before)
    same = all(torch.equal(model(x), base(x)) for x in inputs.values())
    graphs = cg.stats(model).graphs
    cg.ungraphify(model)
    del model
    free_memory()
    assert graphs == len(inputs), graphs
    return mb, seconds, same


def bench_serve() -> list[dict]:
    rows = []
    try:
        rows.append(_a_sizes())
    except Exception as e:  # noqa: BLE001 - a row that failed says why
        rows.append({"workload": "A-sizes", "error": error_text(e)})
    try:
        rows.append(_a_buckets())
    except Exception as e:  # noqa: BLE001
        rows.append({"workload": "A-buckets", "error": error_text(e)})
    try:
        rows.append(_llama_sizes())
    except Exception as e:  # noqa: BLE001
        rows.append({"workload": "llama-sizes", "error": error_text(e)})
    return rows


def _a_sizes() -> dict:
    cfg = WORKLOADS["A"]
    base, x = model_and_input(cfg, "cuda")
    inputs = {b: torch.randn(b, *x.shape[1:], device="cuda", dtype=x.dtype) for b in A_SIZES}
    row: dict = {"workload": "A-sizes", "sizes": A_SIZES}
    with torch.no_grad():
        progress("A-sizes: by hand, one pool, largest first")
        row["hand_mb"] = _hand_pool_mb(base, inputs)
        progress("A-sizes: graphify + capture_sizes")
        row["up_front_mb"], row["up_front_s"], row["up_front_equal"] = \
            _graphify_mb(base, inputs, True)
        progress("A-sizes: graphify on demand, smallest first")
        row["on_demand_mb"], row["on_demand_s"], row["on_demand_equal"] = \
            _graphify_mb(base, inputs, False)
    row["up_front_over_hand"] = row["up_front_mb"] / row["hand_mb"]
    row["on_demand_over_hand"] = row["on_demand_mb"] / row["hand_mb"]
    return row


BUCKETS = [2, 4, 8, 16]


def _a_buckets() -> dict:
    """Workload A at every batch size 1-16: ``bucketed`` over 4 bucket graphs vs a graph per
    size (both captured up front) vs eager: the mean µs per call over the 16 sizes, graph
    memory, and the largest difference from eager's output (padded shapes may pick other
    kernels)."""
    import cudagraphify as cg

    from ._common import time_per_call

    cfg = WORKLOADS["A"]
    base, x = model_and_input(cfg, "cuda")
    sizes = list(range(1, 17))
    inputs = {b: torch.randn(b, *x.shape[1:], device="cuda", dtype=x.dtype) for b in sizes}
    row: dict = {"workload": "A-buckets", "sizes": "1-16", "buckets": BUCKETS}

    def mean_us(fn) -> float:
        return sum(time_per_call(fn, inputs[b], 50, 3, torch.cuda.synchronize)
                   for b in sizes) / len(sizes)

    with torch.no_grad():
        progress("A-buckets: eager")
        row["eager_us"] = mean_us(base)
        for name, graph_sizes in (("exact", sizes), ("bucketed", BUCKETS)):
            progress(f"A-buckets: {name}")
            model = cg.graphify(copy.deepcopy(base))
            before = _pools_bytes()
            cg.capture_sizes(model, lambda b: (inputs[b],), graph_sizes, progress=False)
            row[f"{name}_mb"] = _reserved_mb(before)
            fn = cg.bucketed(model, BUCKETS) if name == "bucketed" else model
            row[f"{name}_max_diff"] = max(float((fn(inputs[b]) - base(inputs[b])).abs().max())
                                          for b in sizes)
            row[f"{name}_us"] = mean_us(fn)
            row[f"{name}_graphs"] = cg.stats(model).graphs
            if name == "bucketed":
                row["refused"] = len(fn.refused)
            cg.ungraphify(model)
            del model, fn
            free_memory()
    return row


def _llama_sizes() -> dict:
    import time

    import transformers

    import cudagraphify as cg

    row: dict = {"workload": "llama-sizes", "sizes": f"1-{LLAMA_SIZES[-1]}", "config": LLAMA}
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA)
    base = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = {b: torch.randint(0, config.vocab_size, (b, 1), device="cuda") for b in LLAMA_SIZES}
    model = cg.graphify(copy.deepcopy(base), max_graphs=len(LLAMA_SIZES))
    with torch.no_grad():
        base(input_ids=ids[1], use_cache=False)  # (lazy initialisation: not the captures')
        before = _pools_bytes()
        progress(f"llama-sizes: capture_sizes of {len(LLAMA_SIZES)} sizes")
        t0 = time.perf_counter()
        done = cg.capture_sizes(model, lambda b: {"input_ids": ids[b], "use_cache": False},
                                LLAMA_SIZES, progress=False)
        row["seconds"] = time.perf_counter() - t0
        row["mb"] = _reserved_mb(before)
        s = cg.stats(model)
        row.update(graphed=len(done.graphed), eager=len(done.eager),
                   warmup_s=s.warmup_seconds, capture_s=s.capture_seconds, summary=str(done))
        row["equal"] = all(torch.equal(model(input_ids=ids[b], use_cache=False).logits,
                                       base(input_ids=ids[b], use_cache=False).logits)
                           for b in (1, 7, 32))
    cg.ungraphify(model)
    del model
    free_memory()
    return row


def format_serve(r: dict) -> str:
    if "error" in r:
        return f"{r['workload']}: error: {r['error']}"
    if r["workload"] == "A-sizes":
        return (f"A-sizes {r['sizes']}: graph memory by hand (one pool, largest first) "
                f"{r['hand_mb']:.1f} MB; capture_sizes {r['up_front_mb']:.1f} MB "
                f"({r['up_front_over_hand']:.2f}x hand, {r['up_front_s']:.2f} s, equal to eager "
                f"{r['up_front_equal']}); on demand smallest first {r['on_demand_mb']:.1f} MB "
                f"({r['on_demand_over_hand']:.2f}x, equal {r['on_demand_equal']})")
    if r["workload"] == "A-buckets":
        return (f"A-buckets batches {r['sizes']}: mean µs per call eager {r['eager_us']:.0f}, "
                f"a graph per size {r['exact_us']:.0f} ({r['exact_graphs']} graphs, "
                f"{r['exact_mb']:.1f} MB), bucketed {r['bucketed_us']:.0f} ({r['bucketed_graphs']}"
                f" graphs of {r['buckets']}, {r['bucketed_mb']:.1f} MB, {r['refused']} buckets "
                f"refused); largest difference from eager {r['bucketed_max_diff']:.2e} "
                f"(a graph per size {r['exact_max_diff']:.2e})")
    return (f"llama-sizes {r['sizes']} (16 layers, hidden 512, bf16, (B, 1) ids): "
            f"{r['graphed']} graphed, {r['eager']} eager in {r['seconds']:.2f} s (warm-up "
            f"{r['warmup_s']:.2f} s, capture {r['capture_s']:.2f} s), {r['mb']:.1f} MB; "
            f"logits equal to eager {r['equal']}")
