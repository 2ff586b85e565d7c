"""GPU A/B (#18): capture_sizes (32 decode sizes of the 16-layer HF Llama, probe on) with the
library found first on sys.path, or in $LIB when set (an exported older library, e.g.
``git archive <rev> cudagraphify | tar -x -C .device/lib-old``). Prints the library's path, the
by-hand floor of this process (one eager warm-up and one torch.cuda.graph per size, one pool)
and capture_sizes' seconds, so that runs alternating two libraries on one warm machine compare
(the host's speed moves between runs: compare each run's ratio to its own floor)."""
import os, sys
if os.environ.get("LIB"):
    sys.path.insert(0, os.environ["LIB"])
import copy, time, warnings
import torch, transformers
import cudagraphify as cg
from cudagraphify.bench.serve import LLAMA, LLAMA_SIZES

warnings.simplefilter("ignore")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(**LLAMA)
base = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
ids = {b: torch.randint(0, cfg.vocab_size, (b, 1), device="cuda") for b in LLAMA_SIZES}
order = sorted(LLAMA_SIZES, reverse=True)


def timed(f):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    r = f()
    torch.cuda.synchronize()
    return r, time.perf_counter() - t0


with torch.no_grad():
    base(input_ids=ids[1], use_cache=False)

    def hand():
        pool, graphs, side = torch.cuda.graph_pool_handle(), [], torch.cuda.Stream()
        for b in order:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                base(input_ids=ids[b], use_cache=False)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                base(input_ids=ids[b], use_cache=False)
            graphs.append(g)
        return graphs
    graphs, floor = timed(hand)
    del graphs
    model = cg.graphify(copy.deepcopy(base), max_graphs=len(LLAMA_SIZES))
    done, t = timed(lambda: cg.capture_sizes(
        model, lambda b: {"input_ids": ids[b], "use_cache": False}, LLAMA_SIZES, progress=False))
    s = cg.stats(model)
    eq = all(torch.equal(model(input_ids=ids[b], use_cache=False).logits,
                         base(input_ids=ids[b], use_cache=False).logits) for b in (1, 7, 32))
    print(f"{os.path.dirname(cg.__file__)}: by hand {floor:.3f} s, capture_sizes {t:.3f} s "
          f"({t / floor:.2f}x the floor; warm-up {s.warmup_seconds:.3f}, capture "
          f"{s.capture_seconds:.3f}), {len(done.graphed)} graphed, logits equal {eq}")
