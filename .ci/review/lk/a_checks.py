"""Leaf-kind review on CUDA: silent replays left open (S1 a Parameter key captured on a plain
copy, S2 attribute reads the probe does not see, S3 bucketed's check keyed without the leaf's
kind), a call kept from its graph (L1 EagerFast), and controls. CPU: tests/test_review_lk.py."""
import contextlib
import copy
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEV, D, N, Flat, all_equal, calls, check, finish, param, rand, same, \
    skip_without_cuda, stats_line, sync_all, twins  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("a_checks")
import cudagraphify as cg  # noqa: E402
from cudagraphify._fast import Fast  # noqa: E402


def finding(label, g, res, why):
    check(all_equal(g, res), f"[finding] {label}", f"{why or 'no replay'}: {res} "
          f"({stats_line(g)})")


def control(label, g, res, why, replays=1):
    check(all(o for o, _ in res) and cg.stats(g).replays >= replays, f"[control] {label}",
          f"{why or 'too few replays'}: {res} ({stats_line(g)})")


# -- S1: a Parameter key's graph captured on a plain static copy -----------------------------
for label, read in (("isinstance(x, nn.Parameter)",
                     lambda x: 2.0 if isinstance(x, nn.Parameter) else 3.0),
                    ("type(x) is torch.Tensor", lambda x: 3.0 if type(x) is torch.Tensor
                     else 2.0)):
    for flat in (False, True):
        g, ref = twins(lambda x, h, read=read: h * read(x), flat)
        res, why = calls(g, ref, param, 5)
        finding(f"S1 Parameter arguments only, a scalar branch on {label} "
                f"({'root' if flat else 'with a piece'})", g, res, why)

torch.manual_seed(0)
ref = Flat(lambda x, h: h * (2.0 if isinstance(x, nn.Parameter) else 3.0)).to(DEV)
g = cg.graphify(copy.deepcopy(ref))
ok, first = True, ""
for i in range(5):
    t = rand()
    xs = [nn.Parameter(t.clone()), nn.Parameter(t.clone())]
    outs = [m(x) for m, x in zip((g, ref), xs)]
    for o in outs:
        o.sum().backward()
    sync_all()
    for a, b, what in ((outs[0].detach(), outs[1].detach(), "output"),
                       (xs[0].grad, xs[1].grad, "x.grad"), (g.w.grad, ref.w.grad, "w.grad")):
        o, w = same(a, b)
        if not o and ok:
            ok, first = False, f"call {i} {what}: {w}"
check(ok and cg.stats(g).replays >= 1, "[finding] S1 a training graph of a Parameter key "
      "(isinstance branch): outputs and grads", f"{first} ({stats_line(g)})")

# -- S2: attribute reads the probe does not see ----------------------------------------------
def tag_scale(x):
    x.scale = 2.0


def tag_param(x):
    x._is_param = True


for label, read, tag in (
        ("inspect.getattr_static(x, 'scale', 1.0)",
         lambda x: inspect.getattr_static(x, "scale", 1.0), tag_scale),
        ("isinstance(x, nn.Parameter) of a tensor with x._is_param = True",
         lambda x: 2.0 if isinstance(x, nn.Parameter) else 3.0, tag_param)):
    def make(i, tag=tag):
        x = rand()
        tag(x)
        return (x,), {}
    g, ref = twins(lambda x, h, read=read: h * read(x), True)
    res, why = calls(g, ref, make, 5)
    finding(f"S2 attributed arguments only, {label}", g, res, why)

# -- S3: bucketed keys its check without the leaf's kind -------------------------------------
for kind in ("attributed", "parameter"):
    torch.manual_seed(0)
    body = (lambda x, h: h * getattr(x, "scale", 1.0)) if kind == "attributed" \
        else (lambda x, h: h * (2.0 if isinstance(x, nn.Parameter) else 1.0))
    ref = Flat(body).to(DEV)
    b = cg.bucketed(cg.graphify(copy.deepcopy(ref)), [N, 2 * N])
    ok, first = True, ""
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(N - 1, D, device=DEV)
            if i >= 2:
                if kind == "attributed":
                    x.scale = 2.0
                else:
                    x = nn.Parameter(x, requires_grad=False)
            o, w = same(b(x), ref(x))
            if not o and ok:
                ok, first = False, f"call {i}: {w}"
    check(ok, f"[finding] S3 bucketed: plain calls, then a {kind} argument of the same batch",
          f"{first} (padded_calls={b.padded_calls} refused={b.refused})")

# -- L1: an attributed call's eager decision takes later plain calls -------------------------
def scaled_first(i, n=3):
    x = rand()
    if i < n:
        x.scale = 2.0
    return (x,), {}


g, ref = twins(lambda x, h: h * x.__dict__.get("scale", 1.0), True)
res, why = calls(g, ref, lambda i: scaled_first(i, 0), 6)
control("plain calls, x.__dict__.get('scale', 1.0): graphed", g, res, why, 3)
g, ref = twins(lambda x, h: h * x.__dict__.get("scale", 1.0), True)
res, why = calls(g, ref, scaled_first, 8)
check(all(o for o, _ in res) and cg.stats(g).replays >= 3,
      "[finding] L1 attributed calls decided eager, then plain calls (their own key graphs)",
      f"{why or 'plain calls run eagerly'}: {res} ({stats_line(g)}; fast path "
      f"{type(g._cudagraphify_state._fast).__name__})")

# -- controls ----------------------------------------------------------------------------------
g, ref = twins(lambda x, h: h * getattr(x, "tag", 1.0), True)
x0 = rand()


def same_object(i):
    if i == 3:
        x0.tag = 2.0
    return (x0,), {}


res, why = calls(g, ref, same_object, 5)
check(all(o for o, _ in res), "[control] the same tensor tagged after its calls",
      f"{why} ({stats_line(g)})")

g, ref = twins(lambda x, h: h * 2.0, True)
res, why = calls(g, ref, param, 5)
control("Parameter arguments: replayed, through Fast", g, res, why, 4)
check(type(g._cudagraphify_state._fast) is Fast, "[control] a Parameter key's fast path",
      repr(g._cudagraphify_state._fast))


class SNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y=None, flag=True):
        h = x * self.w
        if isinstance(x, nn.Parameter):
            h = h + 1
        if y is not None:
            h = h + y
        return h * x.__dict__.get("scale", 1.0)


def later(kind, x):
    if kind == "attributed":
        x.scale = 2.0
        return x
    return nn.Parameter(x, requires_grad=False)


for how in ("graph_region", "share_graph", "capture_sizes", "keyword", "mixed"):
    for kind in ("attributed", "parameter"):
        torch.manual_seed(0)
        if how == "share_graph":
            refs = nn.ModuleList([SNet() for _ in range(3)]).to(DEV)
            gs = copy.deepcopy(refs)
            cg.share_graph(gs)
        else:
            refs = [SNet().to(DEV)]
            gs = [cg.graphify(copy.deepcopy(refs[0]))]
        ok, first = True, ""
        with torch.no_grad():
            if how == "capture_sizes":
                cg.capture_sizes(gs[0], lambda n: (torch.randn(n, D, device=DEV),),
                                 [2 * N, N], progress=False)
            region = cg.graph_region() if how == "graph_region" else contextlib.nullcontext()
            with region:
                for i in range(7):
                    x = rand()
                    if 3 <= i < 6:
                        x = later(kind, x)
                    a, kw = ((), {"x": x}) if how == "keyword" else \
                        ((), {"x": x, "y": None, "flag": True}) if how == "mixed" else ((x,), {})
                    for gm, rm in zip(gs, refs):
                        o, w = same(gm(*a, **kw), rm(*a, **kw))
                        if not o and ok:
                            ok, first = False, f"call {i}: {w}"
        check(ok and cg.stats(gs[0]).replays >= 1,
              f"[control] {how}: plain calls, then {kind} arguments (another key)",
              f"{first} ({stats_line(gs[0])})")

finish("a_checks")
