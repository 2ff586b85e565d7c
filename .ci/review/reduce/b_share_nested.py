"""share_graph end to end over layers whose forward reduces (RMSNorm's mean at decode, a mean
over a size-1 dimension: R1's trigger), values bitwise equal to eager per layer, with the group's
reasons as INFO; and nested tensors on a GPU (N1: a nested buffer; nested outputs and
intermediates made on the device)."""
import copy

from common import DEV, cg, check, info, torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, h, size1=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(h) * 0.1 + 1)
        self.size1 = size1

    def forward(self, x):
        if self.size1:  # x (B, 1, H): mean over the size-1 dim, then a last-dim mean
            x = x.mean(dim=1, keepdim=True) * self.w
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


def share_case(name, h, shape, size1=False, dtype=torch.float32):
    def run():
        torch.manual_seed(0)
        ref = nn.ModuleList(Norm(h, size1) for _ in range(6)).to(DEV, dtype)
        layers = copy.deepcopy(ref)
        group = cg.share_graph(layers)
        with torch.no_grad():
            for step in range(6):
                x = torch.randn(*shape, device=DEV, dtype=dtype)
                y, w = x, x
                for k, (a, b) in enumerate(zip(layers, ref)):
                    y, w = a(y), b(w)
                    if not torch.equal(y, w):
                        return f"step {step} layer {k}: differs from eager"
        s = group.stats()
        info(f"share {name}: per_layer {s.per_layer} retargets {s.retargets} "
             f"reasons {dict(s.reasons)} unproven {s.unproven_slots}")
        group.release()
        return None
    check(f"share_graph {name}: every layer bitwise eager's", run)


share_case("rmsnorm H=4096 T=1", 4096, (1, 4096))
share_case("rmsnorm H=64 T=1", 64, (1, 64))
share_case("rmsnorm H=4096 T=5", 4096, (5, 4096))
share_case("size-1 mean (4,1,64)", 64, (4, 1, 64), size1=True)
share_case("size-1 mean (1,1,64)", 64, (1, 1, 64), size1=True)
share_case("rmsnorm bf16 H=4096 T=1", 4096, (1, 4096), dtype=torch.bfloat16)


# -- nested tensors ------------------------------------------------------------------------------

def eager_equal(name, make_module, args_of, probe="auto"):
    def run():
        torch.manual_seed(0)
        ref = make_module()
        torch.manual_seed(0)  # (not deepcopy: a strided nested CUDA tensor cannot be copied)
        g = cg.graphify(make_module(), probe=probe)
        with torch.no_grad():
            for i in range(4):
                args = args_of(i)
                got, want = g(*args), ref(*args)
                if getattr(want, "is_nested", False):
                    same = all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind()))
                else:
                    same = torch.equal(got, want)
                if not same:
                    return f"call {i}: differs from eager"
        s = cg.stats(g)
        info(f"{name}: captures {s.captures} replays {s.replays} eager {dict(s.eager_calls)}")
        return None
    check(name, run)


class Buf(nn.Module):
    def __init__(self, layout, read=True):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("t", torch.nested.nested_tensor(
            [torch.ones(2, 4), torch.ones(3, 4)], layout=layout))
        self.read = read

    def forward(self, x):
        y = self.lin(x)
        return y * self.t.unbind()[1].sum() if self.read else y


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x, off):
        return self.fn(self.lin(x), off)


def jagged_out(y, off):
    return torch.nested.nested_tensor_from_jagged(y * 2, off)


def jagged_mid(y, off):
    n = torch.nested.nested_tensor_from_jagged(y, off)
    return (n * 3).values() + 1


def strided_out(y, off):
    return torch.nested.as_nested_tensor([y[:2], y[2:]])


def args(i):
    return torch.randn(5, 4, device=DEV), torch.tensor([0, 2, 5], device=DEV)


for lay in (torch.strided, torch.jagged):
    L = str(lay).split(".")[-1]
    for probe in ("auto", False):
        eager_equal(f"N1 nested buffer ({L}, probe={probe}) read: runs, eager's values",
                    lambda lay=lay: Buf(lay).to(DEV), lambda i: (torch.randn(2, 4, device=DEV),),
                    probe)
    eager_equal(f"N1 nested buffer ({L}) never read: runs, eager's values",
                lambda lay=lay: Buf(lay, read=False).to(DEV),
                lambda i: (torch.randn(2, 4, device=DEV),))
for probe in ("auto", False):
    for fn in (jagged_out, jagged_mid, strided_out):
        eager_equal(f"nested {fn.__name__} (probe={probe}): runs, eager's values",
                    lambda fn=fn: Fn(fn).to(DEV), args, probe)
