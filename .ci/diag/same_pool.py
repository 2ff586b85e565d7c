"""GPU diagnosis (#18, static-cache share_graph): are two captures of one HF Llama layer, made
one after the other in one pool (the first released, its outputs dropped), byte-identical but
for host leftovers? And a second layer's capture made the same way: does it differ from the
first layer's only in addresses of its own weights and cache slice? Prints, for each pair, the
8-byte words that differ, classified (pool / own storages / other)."""
import warnings
import torch, transformers
from cudagraphify._cugraph import read_graph

warnings.simplefilter("ignore")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)
model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
cache = transformers.StaticCache(config=cfg, max_cache_len=64)
calls = {}
def hook(mod, a, kw):
    calls.setdefault(id(mod), (a, kw))
for layer in model.model.layers:
    layer.register_forward_pre_hook(hook, with_kwargs=True)
ids = torch.randint(0, 32000, (1, 8), device="cuda")
with torch.no_grad():
    model(input_ids=ids, past_key_values=cache, use_cache=True)  # prefill: sets the cache up
    calls.clear()
    model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True,
          cache_position=torch.tensor([8], device="cuda"))
L = model.model.layers
a0, kw0 = calls[id(L[0])]
print("kwargs:", {k: type(v).__name__ for k, v in kw0.items()}, "args", len(a0))
pool = torch.cuda.graph_pool_handle()

def capture(layer):
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.no_grad(), torch.cuda.graph(g, pool=pool):
        out = layer(*a0, **kw0)
    nodes = read_graph(int(g.raw_cuda_graph()))[0]
    return g, out, nodes

def ranges(layer, k):
    r = [(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in layer.parameters()]
    c = cache.layers[k]
    r += [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in (c.keys, c.values)]
    return r

def classify(n0, n1, own0, own1):
    kinds = {}
    for i, (x, y) in enumerate(zip(n0, n1)):
        assert x.key == y.key, (i, x.name, y.name)
        for c, (p, q) in enumerate(zip(x.chunks, y.chunks)):
            for pos in range(0, len(p), 8):
                w0, w1 = p[pos:pos + 8], q[pos:pos + 8]
                if w0 == w1:
                    continue
                v0, v1 = int.from_bytes(w0, "little"), int.from_bytes(w1, "little")
                o0 = [j for j, (s, n) in enumerate(own0) if s <= v0 < s + n]
                o1 = [j for j, (s, n) in enumerate(own1) if s <= v1 < s + n]
                if o0 and o0 == o1:
                    k = "own"
                elif in_pool(v0) and in_pool(v1):
                    k = "pool"
                elif in_pool(v0) or in_pool(v1):
                    k = "pool-one-side"
                elif len(w0) < 8:
                    k = f"short{len(w0)}"
                else:
                    k = "other"
                kinds.setdefault(k, []).append((i, x.name[:60], c, pos, hex(v0), hex(v1)))
    return {k: len(v) for k, v in kinds.items()}, kinds.get("pool", [])[:4]

keep, _, _ = capture(L[0])  # a live graph in the pool first (the template)
g2, o, A2 = capture(L[0]); del o; g2.reset(); del g2; torch.cuda.synchronize()
g3, o, A3 = capture(L[0]); del o; g3.reset(); del g3; torch.cuda.synchronize()
gk, o, K = capture(L[1]); del o; gk.reset(); del gk
g4, o, A4 = capture(L[0]); del o; g4.reset(); del g4
gk2, o, K2 = capture(L[2]); del o; gk2.reset(); del gk2
segs = [(s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", ())) == tuple(pool)]
def in_pool(v):
    return any(a <= v < a + n for a, n in segs)
print("nodes", len(A2), len(K), "pool segments", len(segs))
print("A2 vs A3:", classify(A2, A3, ranges(L[0], 0), ranges(L[0], 0)))
print("A2 vs K(layer1):", classify(A2, K, ranges(L[0], 0), ranges(L[1], 1)))
print("A3 vs K(layer1):", classify(A3, K, ranges(L[0], 0), ranges(L[1], 1)))
print("A4 vs K2(layer2):", classify(A4, K2, ranges(L[0], 0), ranges(L[2], 2)))
