"""GPU diagnosis (#18, 32 decode sizes of the 16-layer HF Llama in <= 1.5 s): where a size's
time goes. Seconds for the 32 sizes (largest first) of: one eager forward each; by hand (an
eager warm-up on a side stream, then a capture into one pool, replayed once) with
``keep_graph`` off and on (capture_end's share shown: with it on, the graph is instantiated at
its first replay); ``capture_sizes`` with its warm-up/capture split from stats; then
``capture_sizes`` under cProfile (callees of capture_end, callers of the ``__new__`` and
``synchronize`` calls, top own times: the profile inflates the Python parts about twice).

    SCRIPTS=.ci/diag/sizes_split.py bash .ci/gpu"""
import copy, cProfile, pstats, time, warnings, io
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
    torch.cuda.synchronize(); t0 = time.perf_counter(); r = f(); torch.cuda.synchronize()
    return r, time.perf_counter() - t0
with torch.no_grad():
    base(input_ids=ids[1], use_cache=False)
    _, t = timed(lambda: [base(input_ids=ids[b], use_cache=False) for b in order])
    print(f"eager, one forward per size: {t:.3f} s")
    for keep in (False, True):
        def hand():
            pool, graphs, ends = torch.cuda.graph_pool_handle(), [], 0.0
            side = torch.cuda.Stream()
            for b in order:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    base(input_ids=ids[b], use_cache=False)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph(keep_graph=keep)
                with torch.cuda.stream(side):
                    g.capture_begin(pool=pool, capture_error_mode="thread_local")
                    base(input_ids=ids[b], use_cache=False)
                    t1 = time.perf_counter(); g.capture_end(); ends += time.perf_counter() - t1
                torch.cuda.current_stream().wait_stream(side)
                g.replay()
                graphs.append(g)
            return graphs, ends
        (graphs, ends), t = timed(hand)
        print(f"by hand keep_graph={keep}: {t:.3f} s (capture_end {ends:.3f} s)")
        del graphs
    for prof in (False, True):
        model = cg.graphify(copy.deepcopy(base), max_graphs=len(LLAMA_SIZES))
        pr = cProfile.Profile() if prof else None
        if pr: pr.enable()
        done, t = timed(lambda: cg.capture_sizes(model, lambda b: {"input_ids": ids[b], "use_cache": False}, order, progress=False))
        if pr: pr.disable()
        s = cg.stats(model)
        print(f"capture_sizes{' profiled' if prof else ''}: {t:.3f} s (warm-up {s.warmup_seconds:.3f}, capture {s.capture_seconds:.3f}), {len(done.graphed)} graphed, captures {s.captures}")
        if pr:
            out = io.StringIO()
            st = pstats.Stats(pr, stream=out)
            st.print_callees("capture_end")
            st.print_callers("__new__")
            st.print_callers("synchronize")
            st.sort_stats("tottime").print_stats(20)
            print(out.getvalue()[:14000])
        cg.ungraphify(model); del model
