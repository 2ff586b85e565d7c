"""share_graph end to end over two layers that differ only in something a kernel of these
families reads: a scalar in a nocast functor, a strided operand's strides (offset calculator
entries below dims), a cat input's size/stride row, the number of cat inputs, a loader's dtype.
The difference comes from a dict keyed by id(layer), which neither first_difference nor the
attribute guard sees, so the template's diff (template vs its partner) is what must refuse. The
first calls run on zeros, on which both layers agree (so share_graph's first-call bitwise check
cannot tell); later calls are random. Every output must equal eager's bitwise: PASS = refused
or equal. A control case (layers that differ in nothing) must share and match."""
from common import DEV, check, cg, info, torch
from torch import nn

from cudagraphify._cugraph import driver_available

if not driver_available():
    print("SKIP b_share_e2e: the CUDA driver cannot report kernel argument sizes")
    raise SystemExit(0)

CFG: dict[int, object] = {}  # id(layer) -> its hidden per-layer value


class Layer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind  # the same in both layers
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        v = CFG[id(self)]
        if self.kind == "scalar":  # nocast AUnaryFunctor's scalar
            return x[:4, ::2] * v + self.w
        if self.kind == "strides":  # nocast offset calculator strides
            u = x[:4, ::2] if v == 0 else x[::2, :4]
            return u * self.w
        if self.kind == "cat_row":  # CatArrayBatchedCopy row of input 0
            u = x[:4, :4] if v == 0 else x.t()[:4, :4]
            return torch.cat((u, self.w), 1)
        if self.kind == "cat_inputs":  # gridDim.y
            parts = (x[:4, :2], x[:4, 2:4]) if v == 0 else (x[:4, :4],)
            return torch.cat((*parts, self.w), 1)
        if self.kind == "dtype":  # LoadWithCast's dtype byte (x: int16 bits)
            return self.w + x[:4, :4].contiguous().view(v)
        if self.kind == "control":  # Llama-like: strided mul, rotary cat, cast (no difference)
            h = x[:4, :].view(4, 2, 4).transpose(0, 1) * 1.5
            r = torch.cat((-h[..., 2:], h[..., :2]), -1)
            return r.to(torch.float32).sum(0) + self.w
        raise AssertionError(self.kind)


def make_x(kind, step):
    if kind == "dtype":  # int16 bits that are finite in bf16 and in fp16
        x = torch.randint(0x3000, 0x3C00, (8, 8), device=DEV, dtype=torch.int16)
        return x * 0 if step < 3 else x
    dtype = torch.bfloat16 if kind == "control" else torch.float32
    x = torch.randn(8, 8, device=DEV, dtype=dtype)
    return x * 0 if step < 3 else x


def share_case(kind, values):
    def run():
        torch.manual_seed(0)
        layers = nn.ModuleList(Layer(kind) for _ in values).to(DEV)
        for layer, v in zip(layers, values):
            CFG[id(layer)] = v
        group = cg.share_graph(layers)
        try:
            with torch.no_grad():
                for step in range(8):
                    x = make_x(kind, step)
                    for k, layer in enumerate(layers):
                        got = layer(x)
                        want = type(layer).forward(layer, x)
                        if not torch.equal(got, want):
                            s = group.stats()
                            return (f"step {step} layer {k} ({values[k]!r}) differs from eager "
                                    f"(retargets {s.retargets}, per_layer {s.per_layer}, "
                                    f"unproven {s.unproven_slots})")
            s = group.stats()
            info(f"share {kind} {values}: retargets {s.retargets} per_layer {s.per_layer} "
                 f"reasons {[r[:120] for r in s.reasons]}")
            if kind == "control" and s.retargets == 0:
                return f"identical layers did not share: {dict(s.reasons)}"
            return None
        finally:
            group.release()
    check(f"share_graph, layers differing only in {kind} {values}: outputs bitwise eager's", run)


share_case("control", [0, 0, 0])
share_case("scalar", [2.0, 3.0])
share_case("strides", [0, 1])
share_case("cat_row", [0, 1])
share_case("cat_inputs", [0, 1])
share_case("dtype", [torch.bfloat16, torch.float16])
