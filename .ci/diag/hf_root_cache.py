"""GPU check (#16's differential): HF causal LMs called as ``model(ids)`` (use_cache on, no
cache passed: forward makes a DynamicCache and returns it) are one graph: logits and every
cache tensor as eager's (GPT-2 bitwise; Llama within 1e-5: its replays run HF's captured mask
path, see the README's trusted captured paths; the largest difference printed), a new cache
object per call, the returned cache usable for the next (eager-cache) step; µs per call,
eager and graphify.
    SCRIPTS=.ci/diag/hf_root_cache.py bash .ci/gpu"""
import copy, time, warnings
import torch
import cudagraphify as cg
from cudagraphify.bench.differential import MODELS
warnings.simplefilter("ignore")


def near(a, b, tol):
    """Equal (bitwise where ``tol`` is 0); the largest difference kept in ``DIFF``."""
    if torch.equal(a, b):
        return True
    d = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("inf")
    DIFF[0] = max(DIFF[0], d)
    return d <= tol


DIFF = [0.0]


def us(fn, x, n=50):
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


for name in ("llama", "gpt2"):
    torch.manual_seed(0)
    ref, make, pick = MODELS[name]("cuda")
    ref = ref.cuda().eval()
    g = cg.graphify(copy.deepcopy(ref))
    x = make()
    ok = True
    tol, DIFF[0] = (1e-5 if name == "llama" else 0.0), 0.0
    with torch.no_grad():
        outs = []
        for i in range(4):
            o, r = g(x), ref(x)
            ok &= near(o.logits, r.logits, tol)
            ok &= type(o.past_key_values) is type(r.past_key_values)
            for lo, lr in zip(o.past_key_values.layers, r.past_key_values.layers):
                ok &= near(lo.keys, lr.keys, tol) and near(lo.values, lr.values, tol)
            outs.append(o)
        ok &= outs[1].past_key_values is not outs[2].past_key_values
        ok &= outs[2].past_key_values.layers[0].keys.data_ptr() != \
            outs[3].past_key_values.layers[0].keys.data_ptr()
        nxt = torch.randint(0, 500, (2, 1), device="cuda")
        o2 = g(nxt, past_key_values=outs[3].past_key_values)
        r2 = ref(nxt, past_key_values=r.past_key_values)
        ok &= near(o2.logits, r2.logits, tol)
        st = cg.stats(g)
        graphed = st.captures == 1 and st.replays >= 3
        e, gg = us(ref, x), us(g, x)
    print(f"{'PASS' if ok and graphed else 'FAIL'} hf_root_cache {name}: equal={ok} "
          f"(largest difference {DIFF[0]:.1e}, tolerance {tol}) "
          f"captures={st.captures} replays={st.replays} eager={dict(st.eager_calls)} "
          f"eager {e:.0f} us, graphify {gg:.0f} us ({gg / e:.3f}x)")
