"""GPU diagnosis (#16): what merging a decoder layer's pieces would save in launches. An RMSNorm
and three bias-free projections reading its output (a Llama layer's input norm and q/k/v,
bf16, one token): eager; each captured as its own graph (with keep_graph) and replayed in
turn; one graph captured over all four; the four graphs composed as child-graph nodes of one
graph through the driver (ctypes) and launched once. Checks the composite's outputs against
the separate replays and eager (bitwise), then times each form's host cost per call.

    source .device/install.sh && python3 .ci/diag/launch_cost.py"""
import ctypes
import time
import torch
from cudagraphify import _cugraph as cu
torch.manual_seed(0)
dev = "cuda"
h = torch.randn(1, 1, 512, device=dev, dtype=torch.bfloat16)
ln = torch.nn.RMSNorm(512).to(
    dev,
    torch.bfloat16) if hasattr(
        torch.nn,
        "RMSNorm") else torch.nn.LayerNorm(512).to(
            dev,
    torch.bfloat16)
q = torch.nn.Linear(512, 512, bias=False).to(dev, torch.bfloat16)
k = torch.nn.Linear(512, 256, bias=False).to(dev, torch.bfloat16)
v = torch.nn.Linear(512, 256, bias=False).to(dev, torch.bfloat16)
pool = torch.cuda.graph_pool_handle()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        n = ln(h)
        q(n)
        k(n)
        v(n)
torch.cuda.current_stream().wait_stream(s)
graphs = []


def cap(fn):
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    g.instantiate() if hasattr(g, "instantiate") else None
    graphs.append(g)
    return out


static_in = h.clone()
n_out = cap(lambda: ln(static_in))
q_out = cap(lambda: q(n_out))
k_out = cap(lambda: k(n_out))
v_out = cap(lambda: v(n_out))
whole = torch.cuda.CUDAGraph()
with torch.cuda.graph(whole, pool=pool):
    wn = ln(static_in)
    wq, wk, wv = q(wn), k(wn), v(wn)
# composite of the four graphs as child graph nodes
lib = cu._driver()
G = ctypes.c_void_p()
assert lib.cuGraphCreate(ctypes.byref(G), 0) == 0
prev = None
for g in graphs:
    node = ctypes.c_void_p()
    deps = (ctypes.c_void_p * 1)(prev) if prev is not None else None
    rc = lib.cuGraphAddChildGraphNode(ctypes.byref(node),
                                      G,
                                      deps,
                                      1 if prev is not None else 0,
                                      ctypes.c_void_p(int(g.raw_cuda_graph())))
    assert rc == 0, rc
    prev = node
E = ctypes.c_void_p()
assert lib.cuGraphInstantiateWithFlags(ctypes.byref(E), G, ctypes.c_ulonglong(0)) == 0
launch = lib.cuGraphLaunch
launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]


def composite():
    assert launch(E, torch.cuda.current_stream().cuda_stream) == 0


# correctness: new input, composite result equals separate replays and eager
static_in.copy_(torch.randn_like(h))
for g in graphs:
    g.replay()
ref = [t.clone() for t in (n_out, q_out, k_out, v_out)]
for t in (n_out, q_out, k_out, v_out):
    t.zero_()
composite()
torch.cuda.synchronize()
print("composite equals separate replays:", all(torch.equal(a, b)
      for a, b in zip(ref, (n_out, q_out, k_out, v_out))))
e = ln(static_in)
print("equals eager:", torch.equal(q(e), ref[1]))


def t(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    tot = (time.perf_counter() - t0) / n * 1e6
    return host, tot


def sep():
    for g in graphs:
        g.replay()


one = graphs[1]
rows = {"one 1-kernel graph replay (torch)": one.replay,
        "four graph replays (torch)": sep,
        "whole 4-piece graph, one capture (torch)": whole.replay,
        "composite child-graph launch (ctypes)": composite,
        "eager ln+q+k+v": lambda: (lambda n: (q(n),
                                              k(n),
                                              v(n)))(ln(h))}
for r in range(2):
    for name, fn in rows.items():
        host, tot = t(fn)
        print(f"{name:45s} host {host:6.1f} us/call, with sync {tot:6.1f}")
