"""Controls on a real GPU (all should PASS): a model's lifecycle and module hooks after a graph
was captured, against an eager twin (made with copy.deepcopy before graphify).

Checks (an MLP 256 wide, no_grad unless said, each change after three calls):
  [control] ungraphify, a weight change, graphify again with max_graphs=2;
  [control] load_state_dict copying, then assign=True;
  [control] model.cpu() then .cuda() back (new memory; on DEV=cpu: .to("cpu"), a no-op);
  [control] model.half() then .float() back;
  [control] a parameter replaced by a new nn.Parameter;
  [control] nested graphify (a child, then the root), a hook on the child, the child ungraphified;
  [control] a forward hook on a grandchild added after capture, its closure changed, removed;
  [control] a global module forward hook registered after capture, then removed;
  [control] batch sizes beyond max_graphs=2 interleaved with weight updates;
  [control] training: a full backward hook on a submodule added after capture;
  INFO: ungraphify between a training forward and its backward (loud: CudagraphifyError).
Run from the repository root: python3 .ci/review/hunt5/c_controls.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("c_controls.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.modules import module as M  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 256


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Sequential(nn.Linear(W, W), nn.Tanh()),
                         nn.Linear(W, W)).to(C.DEV)


def both(g, ref, fn):
    fn(g)
    fn(ref)


def run(g, ref, changes, n=8, dtype=lambda i: torch.float32, device=lambda i: C.DEV):
    """changes: {call index: fn(g, ref)} applied before that call; compares every call."""
    with torch.no_grad():
        for i in range(n):
            if i in changes:
                changes[i](g, ref)
            x = torch.randn(8, W, device=device(i), dtype=dtype(i))
            got, want = g(x), ref(x)
            C.sync_all()
            ok, why = C.same(got, want)
            if not ok:
                return False, f"call {i}: {why}"
    return True, ""


def case(name, changes, n=8, dtype=lambda i: torch.float32, prepare=None,
         device=lambda i: C.DEV):
    ref = make()
    g = copy.deepcopy(ref)
    if prepare is not None:
        prepare(g)
    cg.graphify(g)
    ok, why = run(g, ref, changes, n, dtype, device)
    C.check(ok, f"[control] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


def mul_(idx, k):
    def fn(m):
        with torch.no_grad():
            m[idx].weight.mul_(k)
    return fn


if __name__ == "__main__":
    case("ungraphify, weight change, graphify(max_graphs=2) again", {
        3: lambda g, ref: cg.ungraphify(g),
        4: lambda g, ref: both(g, ref, mul_(0, 2.0)),
        5: lambda g, ref: cg.graphify(g, max_graphs=2),
        7: lambda g, ref: both(g, ref, mul_(3, -1.0))})

    sd = {k: v * 2 for k, v in make().state_dict().items()}
    case("load_state_dict copying, then assign=True", {
        3: lambda g, ref: both(g, ref, lambda m: m.load_state_dict(sd)),
        5: lambda g, ref: both(g, ref, lambda m: m.load_state_dict(
            {k: v + 1 for k, v in sd.items()}, assign=True))})

    other = "cpu" if C.CPU else "cuda"
    case("model.cpu() then back to the device", {
        3: lambda g, ref: both(g, ref, lambda m: m.to("cpu")),
        4: lambda g, ref: both(g, ref, lambda m: m.to(other))},
        device=lambda i: "cpu" if i == 3 else C.DEV)  # (call 3 on the host, as the model)

    case("model.half() then .float() back", {
        3: lambda g, ref: both(g, ref, lambda m: m.half()),
        5: lambda g, ref: both(g, ref, lambda m: m.float()),
        6: lambda g, ref: both(g, ref, mul_(0, 0.5))},
        dtype=lambda i: torch.float16 if i in (3, 4) else torch.float32)

    w = torch.randn(W, W, device=C.DEV) / 16
    case("a parameter replaced by a new nn.Parameter", {
        3: lambda g, ref: both(g, ref, lambda m: setattr(m[3], "weight", nn.Parameter(w.clone())))})

    hooks = []
    case("nested graphify, a hook on the graphified child, the child ungraphified", {
        3: lambda g, ref: both(g, ref, lambda m: hooks.append(
            m[2].register_forward_hook(lambda mod, a, o: o * 3))),
        5: lambda g, ref: cg.ungraphify(g[2]),
        6: lambda g, ref: [h.remove() for h in hooks]},
        prepare=lambda g: cg.graphify(g[2]))

    st = {"k": 2.0}
    hk = []
    case("a hook on a grandchild added after capture, its closure changed, removed", {
        3: lambda g, ref: both(g, ref, lambda m: hk.append(
            m[2][0].register_forward_hook(lambda mod, a, o: o * st["k"]))),
        4: lambda g, ref: st.update(k=-1.0),
        6: lambda g, ref: [h.remove() for h in hk]})

    gh = []

    def add_global(g, ref):
        gh.append(M.register_module_forward_hook(
            lambda mod, a, o: o + 1 if isinstance(mod, nn.Tanh) else None))
    case("a global module forward hook after capture, then removed", {
        3: add_global, 6: lambda g, ref: gh.pop().remove()})

    # batch sizes beyond max_graphs with weight updates
    ref = make()
    g = cg.graphify(copy.deepcopy(ref), max_graphs=2)
    ok, why = True, ""
    with torch.no_grad():
        for i, b in enumerate([1, 2, 3, 1, 4, 2, 5, 1, 3] * 2):
            x = torch.randn(b, W, device=C.DEV)
            got, want = g(x), ref(x)
            C.sync_all()
            ok, why = C.same(got, want)
            if not ok:
                why = f"call {i} (batch {b}): {why}"
                break
            if i % 3 == 2:
                both(g, ref, mul_(0, 1.01))
            if i % 5 == 4:
                nw = torch.randn(W, W, device=C.DEV) / 16
                both(g, ref, lambda m: setattr(m[3], "weight", nn.Parameter(nw.clone())))
    C.check(ok, "[control] batch sizes beyond max_graphs=2 with weight updates",
            why + " " + C.stats_line(g))

    # training: a full backward hook on a submodule added after capture
    ref = make()
    g = cg.graphify(copy.deepcopy(ref))
    ok, why = True, ""
    for i in range(6):
        if i == 3:
            for m in (g, ref):
                m[3].register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0.5,))
        x = torch.randn(8, W, device=C.DEV)
        a, b = g(x), ref(x)
        a.square().sum().backward()
        b.square().sum().backward()
        C.sync_all()
        ok, why = C.same(a, b)
        for p, q in zip(g.parameters(), ref.parameters()):
            if ok:
                ok, why = C.same(p.grad, q.grad)
        if not ok:
            why = f"step {i}: {why}"
            break
    C.check(ok, "[control] training: a full backward hook on a submodule added after capture",
            why + " " + C.stats_line(g))

    # loud: ungraphify between a training forward and its backward
    g = cg.graphify(make())
    for i in range(3):
        g(torch.randn(8, W, device=C.DEV)).sum().backward()
    out = g(torch.randn(8, W, device=C.DEV))
    cg.ungraphify(g)
    try:
        out.sum().backward()
        C.info("ungraphify before backward: backward ran (no error)")
    except cg.CudagraphifyError as e:
        C.info(f"ungraphify before backward: loud CudagraphifyError: {str(e)[:120]}")
    C.finish("c_controls.py")
