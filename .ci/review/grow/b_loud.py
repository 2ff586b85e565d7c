"""Loud regressions c213750 leaves (G2, G3 of tests/test_review_grow.py); Linear 256 wide.
  [finding] G2 a graph whose alias the caller grew, then released (evicted: max_graphs=1 and a
            second signature): GraphRegion._slots keeps the slot under its capture-time
            address (forget deletes the key at the slot's address now, the caller's), and with
            it the caller's grown storage (32 MB here), until the region closes;
  [finding] G3 torch.utils.swap_tensors on a piecewise piece's output in the root's code, and on
            an explicit region's alias: RuntimeError (Slot.alias is a weakref to it), where
            eager swaps (not from this change);
  [control] a released graph whose alias was not grown leaves its slot's key gone (one slot,
            the new graph's); an object with a ``static`` attribute returned as an argument is
            not taken for a handed output; a training graph whose output copy is grown keeps
            replaying; two threads each in a region of its own, one growing its alias.
Run from the repository root: python3 .ci/review/grow/b_loud.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("b_loud.py")
import copy  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W, DEV, B = C.W, C.DEV, 8
BIG = 32 * 2 ** 20 // (4 * W)  # rows: 32 MB of float32


def rnd(b=B):
    return torch.randn(b, W, device=DEV)


def evicted(grow):
    def run():
        ra, fa = C.pair(0)
        use = torch._C._storage_Use_Count
        with torch.no_grad(), cg.graph_region(max_graphs=1) as region:
            for _ in range(4):
                fa(rnd())
            y = fa(rnd())
            if grow:
                y.resize_(BIG, W)
            storage = y.untyped_storage()
            del y
            C.sync_all()
            before = torch.cuda.memory_allocated() if not C.CPU else 0
            for i in range(5):  # another signature: the first graph is evicted
                x = rnd(B + 1)
                ok, why = C.same(fa(x), ra(x))
                if not ok:
                    return False, f"call {i}: {why}"
            ev = region.stats().evictions
            held = use(storage._cdata) - 1
            n = len(region._slots)
            del storage
            C.sync_all()
            if not C.CPU:
                C.info(f"grow={grow}: allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB "
                       f"after the eviction (before it: {before / 2**20:.1f} MiB)")
        return ev == 1 and held == 0 and n == 1, \
            f"evictions={ev}, references to the caller's storage left={held}, slots={n}"
    return run


class SwapsPieceOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e30:  # a host sync: the root runs piecewise
            y = y * 0
        z = torch.ones_like(y)
        torch.utils.swap_tensors(y, z)
        return self.b(y) + z


def swap_piece():
    torch.manual_seed(0)
    ref = SwapsPieceOutput().to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(6):
            x = rnd()
            ok, why = C.same(g(x), ref(x))
            if not ok:
                return False, f"call {i}: {why}"
    return True, ""


def swap_region():
    ra, fa = C.pair(0)
    with torch.no_grad(), cg.graph_region():
        for _ in range(4):
            fa(rnd())
        x = rnd()
        y, ye = fa(x), ra(x)
        z, ze = torch.zeros(B, W, device=DEV), torch.zeros(B, W, device=DEV)
        torch.utils.swap_tensors(ye, ze)
        torch.utils.swap_tensors(y, z)
        ok, why = C.same(y, ye)
        if ok:
            ok, why = C.same(z, ze)
    return ok, why


class Obj:
    def __init__(self, t):
        self.static = t

    def m(self):
        return self.static


class ReturnsArg(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x, obj):
        return self.lin(x), obj


def static_attribute():
    torch.manual_seed(0)
    ref = ReturnsArg().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    obj = Obj(torch.zeros(3, device=DEV))
    with torch.no_grad():
        for region in (False, True):
            with cg.graph_region() if region else torch.no_grad():
                for i in range(5):
                    x = rnd()
                    a, b = g(x, obj), ref(x, obj)
                    ok, why = C.same(a[0], b[0])
                    if not ok or a[1] is not obj:
                        return False, f"call {i}: {why}"
                    obj.static.resize_(100 + i)
    return C.moved_calls(g) == 0 and cg.stats(g).replays >= 4, C.stats_line(g)


def training():
    torch.manual_seed(0)
    ref = nn.Linear(W, W).to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    for i in range(6):
        x = rnd()
        a, b = g(x), ref(x)
        ok, why = C.same(a, b)
        if not ok:
            return False, f"call {i}: {why}"
        a.sum().backward()
        b.sum().backward()
        a.detach().resize_(50, W)
    # (accumulated gradients: close, as the GPU suite's training tests compare them; a graph
    # adds into .grad in another order than AccumulateGrad)
    ok = torch.allclose(g.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    why = "" if ok else f"weight.grad differs (max abs diff " \
        f"{(g.weight.grad - ref.weight.grad).abs().max().item()})"
    if ok and (C.moved_calls(g) or cg.stats(g).replays < 3):
        ok, why = False, C.stats_line(g)
    return ok, why


def threads():
    ra, fa = C.pair(0)
    errors = []

    def work(seed):
        try:
            gen = torch.Generator(device=DEV).manual_seed(seed)
            with torch.no_grad(), cg.graph_region():
                for i in range(6):
                    x = torch.randn(B, W, device=DEV, generator=gen)
                    y = fa(x)
                    ok, why = C.same(y, ra(x))
                    if not ok:
                        errors.append(f"thread {seed} call {i}: {why}")
                    if seed == 1 and i == 3:
                        y.resize_(64, W)
            C.sync_all()
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {seed}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return not errors, "; ".join(errors)


if __name__ == "__main__":
    C.guarded("finding", "G2 released graph whose alias grew: the region keeps the caller's "
              "grown storage (stale _slots key)", evicted(True))
    C.guarded("control", "released graph whose alias did not grow: only the new graph's slot left",
              evicted(False))
    C.guarded("documented", "G3 (README; expected FAIL) swap_tensors on a piece's output in "
              "the root", swap_piece)
    C.guarded("documented", "G3 (README; expected FAIL) swap_tensors on a region alias",
              swap_region)
    C.guarded("control", "an argument object with a static attribute returned: not handed",
              static_attribute)
    C.guarded("control", "training graph, its output copy grown: keeps replaying", training)
    C.guarded("control", "two threads, a region each, one grows its alias", threads)
    C.finish("b_loud.py")
