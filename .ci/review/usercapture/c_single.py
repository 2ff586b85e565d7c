"""One thread. [control] a whole-graph callable and a root with graphed pieces captured in
the user's torch.cuda.graph (default capture mode, its own stream) after a warm-up on a side
stream: the user's graph replays eager's bits, and outside it the graphs replay again.
[finding] bucketed(graphify(m))'s first call of a batch size inside the user's capture runs
its check (torch.equal, bool(...): host syncs): the capture raises. [control] the same size
checked before the capture: captured fine."""
import copy

import torch
from torch import nn

import cudagraphify as cg
from common import DIM, check, finish, pair, rand, short


def user_capture(fn):
    """The PyTorch recipe: 3 warm-up calls on a side stream, then torch.cuda.graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def captured(kind):
    ref, g, call = pair(kind)
    tag = f"[control] {kind} inside the user's capture"
    with torch.no_grad():
        for _ in range(4):
            x = rand()
            assert torch.equal(call(g, x), call(ref, x))
        static_x = rand()
        try:
            graph, y = user_capture(lambda: call(g, static_x))
        except Exception as e:  # noqa: BLE001
            check(False, f"{tag}: captured", short(e))
            return
        ok = True
        for _ in range(3):
            static_x.copy_(rand())
            graph.replay()
            torch.cuda.synchronize()
            ok = ok and torch.equal(y, call(ref, static_x))
        check(ok, f"{tag}: its replays are eager's bits")
        st = cg.stats(g.a if kind == "pieces" else g)
        before = st.replays
        ok = True
        for _ in range(2):
            x = rand()
            ok = ok and torch.equal(call(g, x), call(ref, x))
        check(ok and cg.stats(g.a if kind == "pieces" else g).replays > before,
              f"{tag}: afterwards its graphs replay eager's bits")


def bucket(checked_first):
    torch.manual_seed(0)
    ref = nn.Linear(DIM, DIM).cuda()
    bm = cg.bucketed(cg.graphify(copy.deepcopy(ref)), sizes=[8])
    tag = ("[control] bucketed, size checked before the capture" if checked_first
           else "[finding] bucketed, first call of a size inside the user's capture")
    with torch.no_grad():
        x = torch.randn(5, DIM, device="cuda")
        if checked_first:
            bm(x)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = bm(x)
        except Exception as e:  # noqa: BLE001
            check(False, f"{tag}: captured", short(e))
            return
        x.copy_(torch.randn(5, DIM, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = ref(x)
        # (padded shapes may pick other kernels: close, as bucketed promises)
        check(torch.allclose(y, want, rtol=1e-3, atol=1e-3), f"{tag}: replays near eager's",
              f"max diff {float((y - want).abs().max()):.3g}")


for kind in ("whole", "pieces"):
    try:
        captured(kind)
    except Exception as e:  # noqa: BLE001
        check(False, f"{kind} ran", short(e))
for first in (True, False):
    try:
        bucket(first)
    except Exception as e:  # noqa: BLE001
        check(False, f"bucketed checked_first={first} ran", short(e))
finish()
