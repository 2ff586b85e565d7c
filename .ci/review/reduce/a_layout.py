"""deb1f4d on real captures: for PyTorch's reduce_kernel nodes, where the ReduceOp's offset
calculators really are (from the argument's size: the input calculator starts 972 or 976 bytes
before its end), whether reduce_unread finds them, and whether anything it calls unread is a
byte the kernel reads (FAIL: R1). INFO lines: candidates when nothing is recognised (R2,
refusal only). Three captures per case, each on fresh inputs (as two layers and the again
capture)."""
from common import DEV, check, info, torch
from cudagraphify._cugraph import read_graph
from cudagraphify._unread import _calc_dims, reduce_unread

S1 = 4 + 25 * 16


def true_layout(chunks):
    """(at, d_in, d_out) from the size: exactly one of len-972 / len-976 valid in all."""
    n = len(chunks[0])
    found = []
    for at in (n - 972, n - 976):
        d = {(_calc_dims(c, at, 1), _calc_dims(c, at + S1, 2)) for c in chunks}
        if len(d) == 1:
            di, do = d.pop()
            if di is not None and do is not None:
                found.append((at, di, do))
    return found


def truly_unread(at, d_in, d_out):
    out = set()
    for start, dims, nargs in ((at, d_in, 1), (at + S1, d_out, 2)):
        out.update(range(start + 4 + 12 * dims, start + 304))
        out.update(range(start + 304 + 4 * nargs * dims, start + 304 + 4 * nargs * 25))
    out -= set(range(at + 304, at + 308))  # thread_reduce reads input strides_[0][0] always
    return frozenset(out)


def padding(at, n):
    """ReduceOp's padding bytes (recognised as unread after this review): after the config's
    vectorize_input bool, between the output calculator and src, before noutputs."""
    return frozenset({at - 7, at - 6, at - 5} | set(range(at + 908, n - 64)) | {n - 6, n - 5})


def candidates(chunks):
    out = []
    for at in range(0, min(256, len(chunks[0])), 4):
        d = {(_calc_dims(c, at, 1), _calc_dims(c, at + S1, 2)) for c in chunks}
        if len(d) == 1:
            di, do = d.pop()
            if di and do is not None:
                out.append((at, di, do))
    return out


def captures(make, fn, n=3):
    nodes = []
    s = torch.cuda.Stream()
    for _ in range(n):
        args = make()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(*args)  # warm-up
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            fn(*args)
        torch.cuda.synchronize()
        nodes.append(read_graph(int(g.raw_cuda_graph()))[0])
        g.reset()
    return nodes


def case(name, make, fn):
    def run():
        caps = captures(make, fn)
        bad = []
        seen = 0
        for i, n0 in enumerate(caps[0]):
            if not n0.name.startswith("_ZN2at6native13reduce_kernel"):
                continue
            seen += 1
            chunks = [c[i].chunks[0] for c in caps]
            real = true_layout(chunks)
            got = reduce_unread(n0.name, chunks)
            cands = candidates(chunks)
            cfg = [int.from_bytes(chunks[0][k:k + 4], "little") for k in range(0, 4 * 24, 4)]
            info(f"{name} node {i}: len {len(chunks[0])} real {real} candidates {cands} "
                 f"unread {len(got)} differing {sum(len({c[k] for c in chunks}) > 1 for k in range(len(chunks[0])))} head-words {cfg}")
            if len(real) != 1:
                bad.append(f"node {i}: layout from the size not unique: {real}")
                continue
            at, di, do = real[0]
            if got and not got <= truly_unread(at, di, do) | padding(at, len(chunks[0])):
                wrong = sorted(got - truly_unread(at, di, do) - padding(at, len(chunks[0])))
                bad.append(f"node {i}: read bytes taken for unread (R1): {wrong[:6]}.. "
                           f"({len(wrong)}), real at {at} dims {di},{do}, found {cands}")
            elif not got and di >= 1:
                info(f"{name} node {i}: real layout at {at} not recognised (R2, refusal only): "
                     f"candidates {cands}")
        if not seen:
            return "no reduce_kernel node"
        return "; ".join(bad) or None
    check(f"reduce layout {name}", run)


f32, bf16 = torch.float32, torch.bfloat16


def rnd(*shape, dtype=f32):
    return lambda: (torch.randn(*shape, device=DEV, dtype=dtype),)


case("rmsnorm mean (1,4096) decode", rnd(1, 4096), lambda x: x.pow(2).mean(-1, keepdim=True))
case("rmsnorm mean (7,4096)", rnd(7, 4096), lambda x: x.pow(2).mean(-1, keepdim=True))
case("rmsnorm mean (1,64)", rnd(1, 64), lambda x: x.pow(2).mean(-1, keepdim=True))
case("bf16->f32 mean (1,4096)", rnd(1, 4096, dtype=bf16),
     lambda x: x.float().pow(2).mean(-1, keepdim=True))
case("sum dim0 (64,32)", rnd(64, 32), lambda x: x.sum(0))
case("var_mean (4,256)", rnd(4, 256), lambda x: torch.var_mean(x, -1))
case("aminmax (4,256)", rnd(4, 256), lambda x: torch.aminmax(x, dim=-1))
case("argmax (4,256)", rnd(4, 256), lambda x: x.argmax(-1))
case("std dim0 (300,5)", rnd(300, 5), lambda x: x.std(0))
case("norm (8,128)", rnd(8, 128), lambda x: x.norm(dim=-1))
case("full sum (1000,)", rnd(1000), lambda x: x.sum())
case("permuted sum (8,16,32)", lambda: (torch.randn(8, 16, 32, device=DEV).permute(2, 0, 1),),
     lambda x: x.sum((1, 2)))
# input calculator dims 0: a reduction over size-1 dimensions only (R1's trigger)
for shape, op in [((4, 1), "mean"), ((1, 1), "sum"), ((3, 1), "mean"), ((8, 1), "amax"),
                  ((2, 1, 16), "mean"), ((1, 1, 4096), "sum")]:
    case(f"size-1 {op} {shape} dim 1", rnd(*shape), lambda x, op=op: getattr(x, op)(1))
