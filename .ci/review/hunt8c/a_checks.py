"""Hunt-8c review on CUDA: reads of what an argument's static copy does not keep that the fix
(3ca76f2, ``_probe.COPY_READS`` / ``Probe.read_metadata``) lets through (S1-S8: silent stale
replays), explain's view of a nested argument (E1), and controls beside them. CPU
reproductions: tests/test_review_hunt8c.py."""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, DEV, D, N, Inner, Net, calls, check, finish, fresh, info, \
    misaligned, offset, refused, same, skip_without_cuda, stats_line, sync_all, \
    twins  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("a_checks")
import cudagraphify as cg  # noqa: E402


def finding(label, pred, first, later, fn=False, grad=False):
    g, ref = twins(pred, fn)
    try:
        ok, why, after = calls(g, ref, first, later, grad=grad)
    except AssertionError as e:  # (the CPU double cannot replay an op with a bool output)
        if CPU:
            info(f"{label}: not on the CPU double ({str(e)[:80]})")
            return
        raise
    check(ok, f"[finding] {label}", why)


# -- S1/S2: data_ptr and storage_offset under other names -----------------------------------
HAS_CONST = hasattr(torch.Tensor, "const_data_ptr")  # (torch 2.11 has none)
for kind in ("module", "fn") if HAS_CONST else ():
    finding(f"S1 x.const_data_ptr() % 16 (aligned, then misaligned) [{kind}]",
            lambda x: x.const_data_ptr() % 16 != 0, fresh, misaligned, fn=kind == "fn")
if not HAS_CONST:
    info("S1: this torch has no Tensor.const_data_ptr")
finding("S2 torch.ops.aten.storage_offset(x) > 0 (offset 0, then 16)",
        lambda x: torch.ops.aten.storage_offset(x) > 0, fresh, offset)
finding("S2 torch.ops.aten.sym_storage_offset(x) > 0 (offset 0, then 16)",
        lambda x: torch.ops.aten.sym_storage_offset.default(x) > 0, fresh, offset)
if CPU:
    info("S2c x.__cuda_array_interface__: CUDA only")
else:
    finding("S2c x.__cuda_array_interface__['data'][0] % 16 (aligned, then misaligned)",
            lambda x: x.__cuda_array_interface__["data"][0] % 16 != 0, fresh, misaligned)


# -- S3: aliasing between two arguments ------------------------------------------------------
def two():
    return torch.randn(N, D, device=DEV), torch.randn(N, D, device=DEV)


def same_tensor():
    t = torch.randn(N, D, device=DEV)
    return t, t


def view_of_one():
    t = torch.randn(N, D, device=DEV)
    return t, t[:]


finding("S3 x is y (g(x, y), then g(t, t))", lambda x, y: x is y, two, same_tensor)
finding("S3 x.is_set_to(y) (g(x, y), then g(t, t))", lambda x, y: x.is_set_to(y), two,
        same_tensor)
finding("S3 torch._C._is_alias_of(x, y) (g(x, y), then g(t, t[:]))",
        lambda x, y: torch._C._is_alias_of(x, y), two, view_of_one)


# -- S4: output_nr ---------------------------------------------------------------------------
def leaf():
    return (torch.randn(N, D, device=DEV).requires_grad_(),)


def second_output():
    with torch.enable_grad():
        return (torch.std_mean(torch.randn(3, N, D, device=DEV, requires_grad=True), dim=0)[1],)


finding("S4 x.output_nr == 0 under no_grad (a leaf, then std_mean's 2nd output)",
        lambda x: x.output_nr == 0, leaf, second_output)


# -- S5: _version of an argument read in place -----------------------------------------------
class KV(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x, kv):
        h = self.inner(x)
        if kv._version > 0:
            return h * 2 + kv
        return h + 1


for how in ("mark_static", "static_argnames"):
    torch.manual_seed(0)
    ref = KV().to(DEV)
    net = copy.deepcopy(ref)
    g = cg.graphify(net, static_argnames="kv") if how == "static_argnames" else cg.graphify(net)
    kv_g, kv_r = torch.zeros(N, D, device=DEV), torch.zeros(N, D, device=DEV)
    if how == "mark_static":
        cg.mark_static(kv_g)
    ok, why = True, ""
    with torch.no_grad():
        for i in range(5):
            if i == 3:  # the caller writes its cache in place: same address, same key
                kv_g.add_(1.0)
                kv_r.add_(1.0)
            x = torch.randn(N, D, device=DEV)
            r0 = cg.stats(g).replays
            a, b = g(x, kv=kv_g), ref(x, kv=kv_r)
            sync_all()
            ok, why = same(a, b)
            if not ok:
                why = f"call {i}: {why}, replayed {cg.stats(g).replays - r0} ({stats_line(g)})"
                break
    check(ok, f"[finding] S5 kv._version > 0 of a {how} argument written in place", why)


# -- S6: a parameter passed in, then its view (grad mode) -------------------------------------
class PArg(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.p = nn.Parameter(torch.randn(N, D))

    def forward(self, x, w):
        h = self.inner(x) * w
        if w._is_view():
            return h * 2
        return h + 1


torch.manual_seed(0)
ref = PArg().to(DEV)
net = copy.deepcopy(ref)
g = cg.graphify(net)
ok, why = True, ""
for i in range(5):
    x = torch.randn(N, D, device=DEV)
    wg, wr = (net.p, ref.p) if i < 3 else (net.p[:], ref.p[:])
    r0 = cg.stats(g).replays
    a, b = g(x, wg), ref(x, wr)
    a.sum().backward()
    b.sum().backward()
    sync_all()
    ok, why = same(a.detach(), b.detach())
    if not ok:
        why = f"call {i}: {why}, replayed {cg.stats(g).replays - r0} ({stats_line(g)})"
        break
check(ok, "[finding] S6 w._is_view() of a parameter argument, then of p[:] (grad mode)", why)


# -- S7: TorchScript -------------------------------------------------------------------------
@torch.jit.script
def scripted_offset(x: torch.Tensor) -> bool:
    return x.storage_offset() > 0


finding("S7 a @torch.jit.script helper's x.storage_offset() > 0",
        lambda x: bool(scripted_offset(x)), fresh, offset)

# -- S8: the class of a copied argument ------------------------------------------------------
finding("S8 isinstance(x, nn.Parameter) (plain tensors, then an unowned Parameter)",
        lambda x: isinstance(x, nn.Parameter), fresh,
        lambda: (nn.Parameter(torch.randn(N, D, device=DEV), requires_grad=False),))


# -- E1: explain and a tensor in a list argument ---------------------------------------------
class NestedRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x, ys):
        h = self.inner(x)
        return h * 2 if ys[0].storage_offset() > 0 else h + 1


torch.manual_seed(0)
model = NestedRead().to(DEV)
g = cg.graphify(copy.deepcopy(model))
with torch.no_grad():
    for _ in range(3):
        g(torch.randn(N, D, device=DEV), [torch.randn(N, D, device=DEV)])
sync_all()
status = {m["path"]: m["status"] for m in cg.explain(
    model, torch.randn(N, D, device=DEV), [torch.randn(N, D, device=DEV)]).to_dict()["modules"]}
check(refused(g, "Tensor.storage_offset") == (status.get("") == "eager"),
      "[finding] E1 explain agrees with graphify on a read of a tensor in a list argument",
      f"explain {status}, graphify {stats_line(g)}")

# -- controls ----------------------------------------------------------------------------------
for label, pred, later, op in [
        ("x.data_ptr() % 16", lambda x: x.data_ptr() % 16 != 0, misaligned, "Tensor.data_ptr"),
        ("x.storage_offset() > 0", lambda x: x.storage_offset() > 0, offset,
         "Tensor.storage_offset")]:
    g, ref = twins(pred)
    ok, why, after = calls(g, ref, fresh, later)
    check(ok and refused(g, op) and after >= 1,
          f"[control] {label} refused (the fix), its Inner piece replays", why)

g, ref = twins(lambda x, y: x is y)
ok, why, after = calls(g, ref, same_tensor, two)
check(ok and cg.stats(g).captures == 2 and not cg.stats(g).eager_calls,
      "[control] x is y with g(t, t) first: a graph of each key (one copy of t, since "
      "hunt8d's fix)", why)

torch.manual_seed(0)
ref = Net(None).to(DEV)
ptr = "const_data_ptr" if HAS_CONST else "data_ptr"
ref.pred = lambda x, m=ref: getattr(m.inner.w, ptr)() % 16 == 0
net = copy.deepcopy(ref)
net.pred = lambda x, m=net: getattr(m.inner.w, ptr)() % 16 == 0
g = cg.graphify(net)
ok, why, after = calls(g, ref, fresh, fresh)
s = cg.stats(g)
check(ok and s.replays == 4 and not s.eager_calls,
      f"[control] a parameter's {ptr} stays graphed", why)


class BufVersion(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.register_buffer("kv", torch.zeros(N, D))

    def forward(self, x):
        h = self.inner(x)
        if self.kv._version > 0:
            return h * 2 + self.kv
        return h + 1


torch.manual_seed(0)
base = BufVersion().to(DEV)  # (both copies: a deepcopy moves its tensors' versions)
ref, g = copy.deepcopy(base), cg.graphify(copy.deepcopy(base))
ok, why = True, ""
with torch.no_grad():
    for i in range(5):
        if i == 3:
            ref.kv.add_(1.0)
            g.kv.add_(1.0)
        x = torch.randn(N, D, device=DEV)
        a, b = g(x), ref(x)
        sync_all()
        ok, why = same(a, b)
        if not ok:
            why = f"call {i}: {why} ({stats_line(g)})"
            break
check(ok and refused(g, "Tensor._version") and cg.stats(g).replays >= 1,
      "[control] a buffer's _version read refused (the fix; S5's sibling)", why or stats_line(g))

finish("a_checks")
