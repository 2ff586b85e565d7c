"""Why a small fp32 HF Llama's graphed logits can differ from eager's (the sizesrehearse and
bypass review scripts' controls): eager against itself, a hand-made torch.cuda.graph,
graphify's own first calls, and capture_sizes, each at decode sizes (B, 1), max |diff|."""
import copy, sys, warnings
import torch, transformers
import cudagraphify as cg

warnings.simplefilter("ignore")
print("cudagraphify from", cg.__file__)
SIZES = [8, 4, 2, 1]
dtype = torch.bfloat16 if "--bf16" in sys.argv else torch.float32
torch.manual_seed(0)
cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                               max_position_embeddings=64)
base = transformers.LlamaForCausalLM(cfg).eval().to("cuda", dtype)
gen = torch.Generator().manual_seed(1)
ids = {b: torch.randint(0, 128, (b, 1), generator=gen).cuda() for b in SIZES}


def eager(b):
    return base(input_ids=ids[b].clone(), use_cache=False).logits


def diff(a, b):
    return f"{(a.float() - b.float()).abs().max().item():.3g}" + (" (equal)" if torch.equal(a, b) else "")


with torch.no_grad():
    want = {b: eager(b) for b in SIZES}
    print("eager again:", {b: diff(eager(b), want[b]) for b in SIZES})
    hand = {}
    for b in SIZES:
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            eager(b)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph(); x = ids[b].clone()
        with torch.cuda.graph(g):
            out = base(input_ids=x, use_cache=False).logits
        g.replay(); torch.cuda.synchronize()
        hand[b] = diff(out, want[b])
    print("hand graph:", hand)
    m = cg.graphify(copy.deepcopy(base), max_graphs=16)
    got = {b: diff(m(input_ids=ids[b].clone(), use_cache=False).logits, want[b]) for b in SIZES}
    got2 = {b: diff(m(input_ids=ids[b].clone(), use_cache=False).logits, want[b]) for b in SIZES}
    s = cg.stats(m)
    print("graphify first calls:", got, "replays:", got2, f"captures {s.captures} replays "
          f"{s.replays} eager {s.eager}", dict(list(s.eager_calls.items())[:2]))
    m = cg.graphify(copy.deepcopy(base), max_graphs=16)
    cg.capture_sizes(m, lambda b: {"input_ids": ids[b].clone(), "use_cache": False}, SIZES,
                     progress=False)
    got = {b: diff(m(input_ids=ids[b].clone(), use_cache=False).logits, want[b]) for b in SIZES}
    s = cg.stats(m)
    print("capture_sizes then calls:", got, f"captures {s.captures} replays {s.replays} "
          f"eager {s.eager}")
