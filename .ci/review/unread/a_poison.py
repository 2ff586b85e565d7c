"""Real launches of the kernels _unread knows (nocast elementwise lambdas with 1-4 operands and
functors of 1-16 bytes, the four cat kernels with 1-4 Dims and more inputs than one launch
takes, casting copies), each captured twice. Every byte that unread_bytes declares unread (from
the two captures) is overwritten in an executable copy of the first capture (0xFF, then random
bytes): if the kernel read any of them, the values (or the process, through an address) change.
The graph's output must equal eager's bitwise. INFO: what was recognised per launch, and bytes
that differ between the captures outside the unread set and 8-byte address slots (a refusal,
never a wrong result)."""
import random

from common import DEV, check, info, torch

from cudagraphify._cugraph import RetargetedExec, driver_available, read_graph
from cudagraphify._unread import unread_bytes

if not driver_available():
    print("SKIP a_poison: the CUDA driver cannot report kernel argument sizes")
    raise SystemExit(0)

FAMILIES = ("gpu_kernel_impl_nocast", "CatArrayBatchedCopy", "LoadWithCast",
            "elementwise_kernel_with_index", "index_copy_kernel_impl",
            "vectorized_elementwise_kernel")
_keep = []  # graphs whose memory the executable copies use


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    _keep.append(g)
    return g, out, read_graph(int(g.raw_cuda_graph()))[0]


def short(name):
    for f in ("CatArrayBatchedCopy_vectorized", "CatArrayBatchedCopy_alignedK_contig",
              "CatArrayBatchedCopy_contig", "CatArrayBatchedCopy", "gpu_kernel_impl_nocast",
              "LoadWithCast", "reduce_kernel", "elementwise_kernel_with_index",
              "index_copy_kernel_impl", "vectorized_elementwise_kernel"):
        if f in name:
            return f
    return name[:40]


def case(label, fn, expect):
    """``expect``: family substrings whose launches must be recognised (some bytes unread)."""
    def run():
        want = fn().clone()
        torch.cuda.synchronize()
        g1, out, nodes1 = capture(fn)
        _, _, nodes2 = capture(fn)
        if [n.key for n in nodes1] != [n.key for n in nodes2]:
            return "the two captures differ in their work"
        patches, seen, unread_of = {}, [], {}
        for i, (n1, n2) in enumerate(zip(nodes1, nodes2)):
            if n1.kind != 0 or not any(f in n1.name for f in FAMILIES):
                continue
            for c, (x, y) in enumerate(zip(n1.chunks, n2.chunks)):
                u = unread_bytes(n1, c, [x, y])
                addr = {p for p in range(0, len(x) - 7, 8)
                        if (int.from_bytes(x[p:p + 8], "little") >> 40) in (0x7E, 0x7F)}
                differ = {p for p in range(len(x)) if x[p] != y[p]}
                left = sorted(p for p in differ - u if p - p % 8 not in addr)
                if left:
                    info(f"{label}: {short(n1.name)} arg {c} ({len(x)} B) differs outside the "
                         f"unread set at {left[:8]} (refusal only)")
                if u:
                    unread_of[(i, c)] = u
                    seen.append(f"{short(n1.name)}[grid {n1.grid}] arg {c}: {len(u)}/{len(x)}")
        info(f"{label}: unread " + ("; ".join(seen) or "none recognised"))
        missing = [f for f in expect if not any(f in s for s in seen)]
        if missing:
            info(f"{label}: expected launches not recognised: {missing} (refusal only)")
        if not unread_of:
            return None
        rng = random.Random(0)
        for pattern in ("0xff", "random"):
            for (i, c), u in unread_of.items():
                buf = bytearray(nodes1[i].chunks[c])
                for p in u:
                    buf[p] = 0xFF if pattern == "0xff" else rng.randrange(256)
                patches.setdefault(i, {})[c] = bytes(buf)
            exe = RetargetedExec(int(g1.raw_cuda_graph()), patches, DEV.index or 0, nodes1)
            try:
                out.zero_()
                exe.launch(torch.cuda.current_stream().cuda_stream)
                torch.cuda.synchronize()
            finally:
                exe.destroy()
            if not torch.equal(out, want):
                bad = (out != want).nonzero()[:4].tolist()
                return f"unread bytes overwritten with {pattern}: output differs at {bad}"
        return None
    check(f"poisoned unread bytes keep eager's values: {label}", run)


torch.manual_seed(0)
bf = dict(device=DEV, dtype=torch.bfloat16)
f32 = dict(device=DEV, dtype=torch.float32)
x4, y4 = torch.randn(2, 8, 16, 32, **bf), torch.randn(2, 1, 16, 32, **bf)
a2 = torch.randn(6, 6, **f32)
c2 = torch.randn(6, 6, **f32) > 0
z = torch.zeros(8, 16, **f32)
x6 = torch.randn(2, 3, 2, 3, 2, 3, **f32)
xc = torch.randn(4, 4, device=DEV, dtype=torch.complex128)
t140 = torch.randn(140, 8, **f32)
base = torch.randn(13, **f32)
p1, p2 = torch.randn(4, 3, **f32), torch.randn(4, 3, **f32)
cl = torch.randn(2, 4, 3, 3, **f32).to(memory_format=torch.channels_last)
h16 = torch.randn(6, 6, device=DEV, dtype=torch.float16)
i64 = torch.randint(-1000, 1000, (8, 8), device=DEV)


def fill():
    z.zero_()
    z[:, ::2].fill_(3.25)
    return z.clone()


N = "gpu_kernel_impl_nocast"
C = "CatArrayBatchedCopy"
case("nocast mul, 3 operands (Llama's rotary)", lambda: x4.transpose(1, 2) * y4.transpose(1, 2), [N])
case("nocast neg, 2 operands", lambda: -x4[..., 16:], [N])
case("nocast add alpha=2.5, 3 operands (4-byte functor after the addresses)",
     lambda: torch.add(x4.transpose(1, 2), y4.transpose(1, 2), alpha=2.5), [N])
case("nocast mul by a python scalar (functor holds it)", lambda: x4.transpose(1, 2) * 1.75, [N])
case("nocast fill of a strided view, 1 operand", fill, [N])
case("nocast where, 4 operands", lambda: torch.where(c2.t(), a2.t(), a2), [N])
case("nocast clamp(min, max)", lambda: a2.t().clamp(-0.5, 0.5), [N])
case("nocast 6-D permute + 1 (6 dims)", lambda: x6.permute(5, 4, 3, 2, 1, 0) + 1.0, [N])
case("nocast complex128 mul", lambda: xc.t() * xc, [N])
case("cat base, Dims 4 (Llama's rotary)", lambda: torch.cat((-x4[..., 16:], x4[..., :16]), -1), [C])
case("cat base, Dims 2, three inputs",
     lambda: torch.cat((a2[:, :3], a2[:, 3:5], a2.t()[:, :2]), 1), [C])
case("cat base, 72 inputs (launches of 64 and 8: offsets carry on)",
     lambda: torch.cat([a2.t()[:, k % 6:k % 6 + 1] for k in range(72)], 1), [C])
case("cat contiguous, dim 1 (bf16)", lambda: torch.cat((x4, y4), 1), [C])
case("cat contiguous, dim 2 of 4-D (vectorized: Dims = dim + 1)", lambda: torch.cat((x4, x4), 2), [C])
case("cat contiguous fp32 (4,3)+(4,3) along 1 (alignedK)", lambda: torch.cat((p1, p2), 1), [C])
case("cat contiguous, misaligned inputs (_contig)",
     lambda: torch.cat((base[1:7].view(2, 3), base[7:13].view(2, 3)), 0), [C])
case("cat contiguous, 140 inputs (launches of 128 and 12)",
     lambda: torch.cat([t140[k:k + 1] for k in range(140)], 0), [C])
case("cat channels_last along 1", lambda: torch.cat((cl, cl), 1), [C])
case("stack", lambda: torch.stack((a2, a2.t())), [C])
case("cast bf16 -> fp32 (.to)", lambda: x4.to(torch.float32), ["LoadWithCast"])
case("cast fp32 + fp16 (LoadWithCast<2>)", lambda: a2 + h16, ["LoadWithCast"])
case("cast int64 -> fp16", lambda: i64.to(torch.float16), ["LoadWithCast"])


# (HF's StaticCache decode step: its update's index_copy_, an arange)
kv = torch.zeros(1, 4, 17, 64, **bf)
src = torch.randn(1, 4, 1, 64, **bf)
pos = torch.tensor([9], device=DEV)


def index_copy():
    kv.index_copy_(2, pos, src)
    return kv.clone()


case("index_copy_ into a bf16 cache along dim 2", index_copy, ["index_copy_kernel_impl"])
case("arange int64", lambda: torch.arange(17, device=DEV), ["elementwise_kernel_with_index"])
case("arange float step 0.5", lambda: torch.arange(0, 8, 0.5, device=DEV),
     ["elementwise_kernel_with_index"])

# (captureless host-device lambdas: HF Llama's RMSNorm pow(2), its mask's where)
case("pow(2), contiguous (vectorized, 8-byte lambda)", lambda: x4.float().pow(2),
     ["vectorized_elementwise_kernel"])
case("pow(2) of a transpose (nocast, captureless lambda)", lambda: a2.t().pow(2), [N])
case("pow(3) of a bf16 transpose", lambda: x4.transpose(1, 2).pow(3), [N])
case("pow(2.5) (captures the exponent: its bytes read)", lambda: a2.abs().pow(2.5), [])
case("where over bf16, strided", lambda: torch.where(c2.t(), a2.t().bfloat16(), a2.bfloat16()),
     [N])
