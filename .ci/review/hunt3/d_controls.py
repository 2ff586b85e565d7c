"""Controls on a real GPU (all should PASS): global flags toggled between calls and structure
changes after capture, against an eager twin run under the same settings.

A flag that changes which kernels run (TF32, fp32 matmul precision, SDPA backend, autocast
dtype, default dtype) must make the next call capture again or run eagerly: a replay under the
new setting must give what eager gives under it. Where a check fails, its line says whether the
graphed result equals eager's under the previous setting (a stale replay).
Checks:
  [control] torch.backends.cuda.matmul.allow_tf32 off -> on -> off (Linear 1024);
  [control] torch.set_float32_matmul_precision highest -> high -> highest;
  [control] torch.backends.cudnn.allow_tf32 on -> off (Conv2d);
  [control] torch.nn.attention.sdpa_kernel FLASH -> MATH -> EFFICIENT (fp16);
  [control] autocast bfloat16 -> float16 -> off;
  [control] torch.set_default_dtype float64 for one call (torch.full in forward);
  [control] a block replaced, a BatchNorm submodule put in train mode, model.half().
Run from the repository root: python3 .ci/review/hunt3/d_controls.py
"""
import contextlib
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("d_controls.py")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402


def setter(get, put, value):
    """A context that sets a flag through torch's setter and puts it back."""
    @contextlib.contextmanager
    def ctx():
        old = get()
        put(value)
        try:
            yield
        finally:
            put(old)
    return ctx


def flag_case(name, make, make_x, ctxs, outs=lambda y: y):
    torch.manual_seed(0)
    ref = make()
    g = cg.graphify(copy.deepcopy(ref))
    ok, why, prev = True, "", None
    with torch.no_grad():
        for i, ctx in enumerate(ctxs):
            x = make_x()
            with ctx():
                got, want = outs(g(x)), outs(ref(x))
            C.sync_all()
            ok, why = C.same(got, want)
            if not ok:
                if prev is not None:
                    with prev():
                        old = outs(ref(x))
                    why += f"; equals eager under the previous setting: {C.same(got, old)[0]}"
                why = f"call {i}: {why}"
                break
            prev = ctx
    C.check(ok, f"[control] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


def lin(d=1024):
    return lambda: nn.Sequential(nn.Linear(d, d), nn.Linear(d, d)).to(C.DEV).eval()


def x_of(*shape, dtype=torch.float32):
    return lambda: torch.randn(*shape, device=C.DEV, dtype=dtype)


class Attn(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q * 0.5, q + 1.0, is_causal=True)


class Fill(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x) + torch.full((64,), 0.1, device=x.device).float(), \
            torch.full((3,), 1 / 3, device=x.device)


def n(k, ctx):
    return [ctx] * k


def structure_case(name, change, dtype=torch.float32):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU(),
                        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to(C.DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    ok, why = True, ""
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                dtype = change(g, ref) or dtype
            x = torch.randn(32, 256, device=C.DEV, dtype=dtype if i >= 3 else torch.float32)
            got, want = g(x), ref(x)
            C.sync_all()
            ok, why = C.same(got, want)
            if ok:
                for (k, a), (_, b) in zip(g.state_dict().items(), ref.state_dict().items()):
                    if not torch.equal(a, b):
                        ok, why = False, f"{k} differs from eager's"
            if not ok:
                why = f"call {i}: {why}"
                break
    C.check(ok, f"[control] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


if __name__ == "__main__":
    nul = contextlib.nullcontext
    m = torch.backends.cuda.matmul
    tf32 = setter(lambda: m.allow_tf32, lambda v: setattr(m, "allow_tf32", v), True)
    no_tf32 = setter(lambda: m.allow_tf32, lambda v: setattr(m, "allow_tf32", v), False)
    flag_case("matmul.allow_tf32 off -> on -> off", lin(), x_of(64, 1024),
              n(3, no_tf32) + n(3, tf32) + n(2, no_tf32))
    prec = torch.get_float32_matmul_precision, torch.set_float32_matmul_precision
    flag_case("set_float32_matmul_precision highest -> high -> highest", lin(), x_of(64, 1024),
              n(3, setter(*prec, "highest")) + n(3, setter(*prec, "high"))
              + n(2, setter(*prec, "highest")))
    cd = torch.backends.cudnn
    flag_case("cudnn.allow_tf32 on -> off (Conv2d)",
              lambda: nn.Conv2d(64, 64, 3, padding=1).to(C.DEV).eval(), x_of(4, 64, 32, 32),
              n(3, setter(lambda: cd.allow_tf32, lambda v: setattr(cd, "allow_tf32", v), True))
              + n(3, setter(lambda: cd.allow_tf32, lambda v: setattr(cd, "allow_tf32", v),
                            False)))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if C.CPU:
        kinds, qdtype = [SDPBackend.MATH] * 3, torch.float32
    else:
        kinds = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION]
        qdtype = torch.float16
    flag_case("sdpa_kernel FLASH -> MATH -> EFFICIENT", lambda: Attn(),
              x_of(2, 8, 256, 64, dtype=qdtype),
              [lambda k=k: sdpa_kernel(k) for k in kinds for _ in range(3)])
    ac = "cpu" if C.CPU else "cuda"
    flag_case("autocast bfloat16 -> float16 -> off", lin(256), x_of(64, 256),
              n(3, lambda: torch.autocast(ac, dtype=torch.bfloat16))
              + n(3, lambda: torch.autocast(ac, dtype=torch.float16)) + n(2, nul))
    dd = torch.get_default_dtype, torch.set_default_dtype
    flag_case("set_default_dtype float64 for one call", lambda: Fill().to(C.DEV).eval(),
              x_of(8, 64), n(3, nul) + [setter(*dd, torch.float64)] + n(2, nul),
              outs=lambda y: y[1])

    def replace(g, ref):
        torch.manual_seed(3)
        new = nn.Linear(256, 256).to(C.DEV)
        g[3], ref[3] = copy.deepcopy(new), copy.deepcopy(new)

    structure_case("a block replaced (model[3] = Linear)", replace)
    structure_case("BatchNorm submodule put in train mode",
                   lambda g, ref: (g[1].train(), ref[1].train()) and None)
    structure_case("model.half()" if not C.CPU else "model.double()",
                   lambda g, ref: (g.to(torch.float64 if C.CPU else torch.float16),
                                   ref.to(torch.float64 if C.CPU else torch.float16))
                   and (torch.float64 if C.CPU else torch.float16))
    C.finish("d_controls.py")
