"""Which nocast elementwise launches _unread.nocast_unread does not recognise, and why: the
kernel's name, its arguments' sizes, the operand count the name gives, and the lambda's tail
(the bytes after the calculator and the operand addresses). Launches of the review's
.ci/review/unread/a_poison.py cases that came out "not recognised" on the H100."""
import torch

from cudagraphify._cugraph import read_graph
from cudagraphify._unread import _calc_size, _nocast_operands, nocast_unread

f32 = dict(device="cuda", dtype=torch.float32)
x4 = torch.randn(2, 8, 16, 32, device="cuda", dtype=torch.bfloat16)
a2 = torch.randn(6, 6, **f32)
x6 = torch.randn(2, 3, 2, 3, 2, 3, **f32)
z = torch.zeros(8, 16, **f32)
CASES = {"mul by a python scalar": lambda: x4.transpose(1, 2) * 1.75,
         "fill": lambda: z[:, ::2].fill_(3.25),
         "clamp": lambda: a2.t().clamp(-0.5, 0.5),
         "6-D + 1": lambda: x6.permute(5, 4, 3, 2, 1, 0) + 1.0}
for label, fn in CASES.items():
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    for n in read_graph(int(g.raw_cuda_graph()))[0]:
        if "gpu_kernel_impl_nocast" not in n.name:
            continue
        arg = n.chunks[1] if len(n.chunks) > 1 else b""
        ops = _nocast_operands(n.name)
        tail = arg[-32:].hex() if arg else ""
        print(f"{label}: {n.name}\n  sizes {[len(c) for c in n.chunks]} operands {ops} "
              f"calc+data {(-(-_calc_size(ops) // 8) * 8 + 8 * ops) if ops else None} "
              f"unread {len(nocast_unread(n.name, [arg, arg]))} last 32 bytes {tail} "
              f"dims {int.from_bytes(arg[:4], 'little') if arg else None}", flush=True)
