"""#18 (32 sizes in <= 1.5 s): what a probed forward costs per torch call, against lighter
modes a later size's capture could run under instead. A tiny HF Llama (16 layers, hidden 64,
eager on the CPU; on a GPU machine the same numbers scale with its host): ms per forward, best of
7, and µs per call over eager, for: eager; a mode that only calls through; a light mode (the op
sequence, and each tensor argument's storage checked against the known and made storages:
what ``_rehearsal.confirms`` asks beyond version counters); the full ``Probe`` (screening,
writes, layouts, provenance). Run from the repository root: ``python .ci/diag/probe_cost.py``
(needs transformers)."""
import sys, time, warnings
import torch, transformers
from torch.overrides import TorchFunctionMode
from cudagraphify._probe import Probe
from cudagraphify._policy import default_policy
from cudagraphify._signature import storage_of
from cudagraphify.bench.serve import LLAMA
warnings.simplefilter("ignore")
torch.set_num_threads(1)
torch.manual_seed(0)
cfg = transformers.LlamaConfig(**dict(LLAMA, vocab_size=1000, hidden_size=64, intermediate_size=128))
m = transformers.LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 1000, (4, 1))
statics = {storage_of(t) for t in list(m.parameters()) + list(m.buffers())}
_Tensor = torch.Tensor

class Count(TorchFunctionMode):
    n = 0
    def __torch_function__(self, func, types, args=(), kwargs=None):
        Count.n += 1
        return func(*args, **(kwargs or {}))

class Bare(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

class Light(TorchFunctionMode):
    """op sequence + provenance of every tensor argument's storage."""
    def __init__(self, known):
        super().__init__()
        self.seq, self.known, self.outside = [], set(known), []
    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seq.append(func)
        known = self.known
        for v in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(v, _Tensor):
                p = storage_of(v)
                if p not in known:
                    self.outside.append(p)
            elif isinstance(v, (list, tuple)):
                for t in v:
                    if isinstance(t, _Tensor):
                        p = storage_of(t)
                        if p not in known:
                            self.outside.append(p)
        out = func(*args, **kwargs) if kwargs else func(*args)
        if isinstance(out, _Tensor):
            known.add(storage_of(out))
        elif isinstance(out, (list, tuple)):
            for t in out:
                if isinstance(t, _Tensor):
                    known.add(storage_of(t))
        return out

def best(f, n=7):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3

with torch.no_grad():
    m(input_ids=ids, use_cache=False)
    with Count():
        m(input_ids=ids, use_cache=False)
    n = Count.n
    def bare():
        with Bare(): m(input_ids=ids, use_cache=False)
    def light():
        with Light(statics | {storage_of(ids)}) as L: m(input_ids=ids, use_cache=False)
    def probe():
        p = Probe(m, default_policy)
        p.known = statics | {storage_of(ids)}
        p.written = set()
        with p: m(input_ids=ids, use_cache=False)
    e = best(lambda: m(input_ids=ids, use_cache=False))
    rows = {"eager": e, "bare mode": best(bare), "light mode": best(light), "full probe": best(probe)}
    for k, v in rows.items():
        print(f"{k:12} {v:7.2f} ms  (+{(v - e) * 1e3 / n:5.1f} µs per op over eager, {n} ops)")
    with Light(statics | {storage_of(ids)}) as L:
        m(input_ids=ids, use_cache=False)
    print("light: outside storages", len(set(L.outside)), "ops", len(L.seq))
