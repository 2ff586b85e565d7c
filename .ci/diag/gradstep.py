"""GPU diagnosis (run through .ci/gpu, SCRIPTS=.ci/diag/gradstep.py): the differential bench's
"grad mode" step (the warm-up's output kept, so its backward is pending and the calls run
eagerly) was 4-6% slower than eager on whole-model graphs (issue 16), where the CPU double shows
about 2 µs a call. Where does the time go? Eager vs graphify vs the graphified model's own
forward called directly, interleaved (best of 7), what the timed calls did, then a cProfile of 50
graphified calls. Models: the arguments (default: ours bert resnet18 llama)."""
import copy, time, cProfile, pstats, io, sys, warnings
import torch
import cudagraphify as cg
from cudagraphify.bench.differential import MODELS, steps, apply_step, path_taken

warnings.simplefilter("ignore")
dev = "cuda"
sync = torch.cuda.synchronize
def tpc(fn, x, calls=20):
    sync(); t0 = time.perf_counter()
    for _ in range(calls): fn(x)
    sync(); return (time.perf_counter() - t0) / calls * 1e6

for name in sys.argv[1:] or ("ours", "bert", "resnet18", "llama"):
    try:
        ref, make, pick = MODELS[name](dev)
    except Exception as e:
        print(name, "skipped", e); continue
    torch.manual_seed(0)
    ref = ref.to(dev).eval()
    g = cg.graphify(copy.deepcopy(ref))
    for step, change, kwargs, ctx in steps("cuda"):
        x = apply_step(step, change, make, kwargs, ref, g)
        with ctx():
            for _ in range(6):
                got, want = pick(g(x)), pick(ref(x))
        if step != "grad mode":
            continue
        raw = g.forward.__wrapped__
        with ctx():
            best = {"eager": 1e9, "graphed": 1e9, "raw": 1e9}
            before = cg.stats(g)
            for _ in range(7):
                for k, fn in (("eager", ref), ("graphed", g), ("raw", raw)):
                    best[k] = min(best[k], tpc(fn, x))
            print(f"{name} grad step: " + ", ".join(f"{k} {v:.0f}" for k, v in best.items()),
                  f"graphed/eager {best['graphed']/best['eager']:.3f} raw/eager {best['raw']/best['eager']:.3f}")
            print("   timed calls:", path_taken(before, cg.stats(g))[:300])
            st = g._cudagraphify_state
            print("   fast:", type(st._fast).__name__, "stats eager:", dict(cg.stats(g).eager_calls))
            pr = cProfile.Profile(); pr.enable()
            for _ in range(50): g(x)
            sync(); pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("cudagraphify", 30)
            print("\n".join(l for l in s.getvalue().splitlines() if "cudagraphify" in l or "ncalls" in l)[:5000])
        break
