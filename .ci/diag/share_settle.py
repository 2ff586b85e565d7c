"""#18's share_graph row on HF models (``--share-hf``): share_graph took 4122 µs a forward on an
8-layer Llama against 2288 for per-layer graphify, yet 4120 against 4227 on 16 layers, and
1637 against 1161 on a 12-layer GPT-2 (H100, 2026-12-07). The bench times after three calls,
the median of its repeats. This prints, for each model and for per-layer graphify and
share_graph, the best µs of each window of 10 calls over the first 150 calls (does it settle
late?), eager's alongside, the group's stats, and a cProfile of 30 share_graph calls after
them (top own time). GPU only."""
import copy
import cProfile
import pstats
import sys
import time
import warnings

import torch

import cudagraphify as cg
from cudagraphify.bench.sections import _hf_model

warnings.simplefilter("ignore")
ids = torch.randint(0, 32000, (1, 16), device="cuda")


def logits(m):
    return m(input_ids=ids, use_cache=False).logits


def windows(m, n=150, w=10):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits(m)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e6)
    return [round(min(ts[k:k + w])) for k in range(0, n, w)]


for arch, depth in [("llama", 8), ("llama", 16), ("gpt2", 12)][: int(sys.argv[1]) if len(sys.argv) > 1 else 3]:
    ref, layers_of = _hf_model(arch, depth)
    with torch.no_grad():
        want = logits(ref)
        print(f"{arch}-L{depth} eager windows {windows(ref, 30)}", flush=True)
        for label in ("per_layer", "share_graph"):
            model = copy.deepcopy(ref)
            layers = layers_of(model)
            group = cg.share_graph(layers) if label == "share_graph" else None
            if group is None:
                for layer in layers:
                    cg.graphify(layer)
            w = windows(model)
            print(f"  {label}: windows {w} equal {torch.equal(logits(model), want)}", flush=True)
            if group is not None:
                print(f"  {group.stats()}", flush=True)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(30):
                    logits(model)
                torch.cuda.synchronize()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            model = layers = group = None
