"""GPU check (#16's differential): HF causal LMs called as ``model(ids)`` (use_cache on, no
cache passed: forward makes a DynamicCache and returns it) are one graph: logits and every
cache tensor bitwise as eager's, a new cache object per call, the returned cache usable for
the next (eager-cache) step; µs per call, eager and graphify.
    SCRIPTS=.ci/diag/hf_root_cache.py bash .ci/gpu"""
import copy, time, warnings
import torch
import cudagraphify as cg
from cudagraphify.bench.differential import MODELS
warnings.simplefilter("ignore")


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
    with torch.no_grad():
        outs = []
        for i in range(4):
            o, r = g(x), ref(x)
            ok &= torch.equal(o.logits, r.logits)
            ok &= type(o.past_key_values) is type(r.past_key_values)
            for lo, lr in zip(o.past_key_values.layers, r.past_key_values.layers):
                ok &= torch.equal(lo.keys, lr.keys) and torch.equal(lo.values, lr.values)
            outs.append(o)
        ok &= outs[1].past_key_values is not outs[2].past_key_values
        ok &= outs[2].past_key_values.layers[0].keys.data_ptr() != \
            outs[3].past_key_values.layers[0].keys.data_ptr()
        nxt = torch.randint(0, 500, (2, 1), device="cuda")
        o2 = g(nxt, past_key_values=outs[3].past_key_values)
        r2 = ref(nxt, past_key_values=r.past_key_values)
        ok &= torch.equal(o2.logits, r2.logits)
        st = cg.stats(g)
        graphed = st.captures == 1 and st.replays >= 3
        e, gg = us(ref, x), us(g, x)
    print(f"{'PASS' if ok and graphed else 'FAIL'} hf_root_cache {name}: equal={ok} "
          f"captures={st.captures} replays={st.replays} eager={dict(st.eager_calls)} "
          f"eager {e:.0f} us, graphify {gg:.0f} us ({gg / e:.3f}x)")
