"""GPU diagnosis (#18, 32 decode sizes of the 16-layer HF Llama in <= 1.5 s): the floor and
where capture_sizes stands. Seconds for the 32 sizes (largest first) of: one eager forward each;
by hand (one eager warm-up on a side stream, then torch.cuda.graph into one pool); capture_sizes
as it is; capture_sizes with probe=False. The warm-up/capture split from stats."""
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
    _, t = timed(lambda: [base(input_ids=ids[b], use_cache=False) for b in order])
    print(f"eager, one forward per size: {t:.3f} s")

    def hand():
        pool, graphs = torch.cuda.graph_pool_handle(), []
        side = torch.cuda.Stream()
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
    graphs, t = timed(hand)
    print(f"by hand (warm-up + capture per size, one pool): {t:.3f} s")
    del graphs
    for label, opts in (("capture_sizes", {}), ("capture_sizes probe=False", {"probe": False})):
        model = cg.graphify(copy.deepcopy(base), max_graphs=len(LLAMA_SIZES), **opts)
        done, t = timed(lambda: cg.capture_sizes(
            model, lambda b: {"input_ids": ids[b], "use_cache": False}, LLAMA_SIZES,
            progress=False))
        s = cg.stats(model)
        print(f"{label}: {t:.3f} s (warm-up {s.warmup_seconds:.3f}, capture "
              f"{s.capture_seconds:.3f}), {len(done.graphed)} graphed, {len(done.eager)} eager, "
              f"captures {s.captures}, pieces {len(s.pieces) if hasattr(s, 'pieces') else '?'}")
        eq = all(torch.equal(model(input_ids=ids[b], use_cache=False).logits,
                             base(input_ids=ids[b], use_cache=False).logits) for b in (1, 7, 32))
        print(f"  logits equal {eq}; eager reasons {dict(list(s.eager_calls.items())[:3])}")
        cg.ungraphify(model)
        del model
