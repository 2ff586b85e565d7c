"""GPU diagnosis (SCRIPTS=.ci/diag/sizes_profile.py): issue 18 asks for 32 decode sizes of a
16-layer HF Llama captured in <= 1.5 s (last measured 3.45-3.63 s: warm-up 2.0 s, capture
1.1 s). Where does a size's time go? Eager forward time per size for reference, then
capture_sizes over 32 sizes under cProfile: the top functions by cumulative and own time."""
import copy, cProfile, pstats, time, warnings
import torch, transformers
import cudagraphify as cg
from cudagraphify.bench.serve import LLAMA, LLAMA_SIZES

print(cg.__file__)
warnings.simplefilter("ignore")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(**LLAMA)
base = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
ids = {b: torch.randint(0, cfg.vocab_size, (b, 1), device="cuda") for b in LLAMA_SIZES}
with torch.no_grad():
    for b in (1, 32):
        base(input_ids=ids[b], use_cache=False)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for b in LLAMA_SIZES:
        base(input_ids=ids[b], use_cache=False)
    torch.cuda.synchronize()
    print(f"eager: 32 sizes, one forward each: {time.perf_counter() - t0:.3f} s")
    model = cg.graphify(copy.deepcopy(base), max_graphs=len(LLAMA_SIZES))
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    done = cg.capture_sizes(model, lambda b: {"input_ids": ids[b], "use_cache": False},
                            LLAMA_SIZES, progress=False)
    pr.disable()
    s = cg.stats(model)
    print(done)
    print(f"profiled total {time.perf_counter() - t0:.3f} s, warmup {s.warmup_seconds:.3f} s, "
          f"capture {s.capture_seconds:.3f} s, captures {s.captures}")
st = pstats.Stats(pr)
st.sort_stats("cumulative").print_stats("cudagraphify", 50)
st.sort_stats("tottime").print_stats(30)
