"""a432bc4: retired pieces. R7/R8 are expected to FAIL until fixed (an outer graph that ran a
piece misses a real change of it and replays stale); the rest are controls."""
import functools

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _watch
from common import (DEV, Outer, check, counters, give_back, guarded, randn, root_pair)


def outer_after(tag, change):
    ref, g, ok = root_pair()
    outer, outer_ref = cg.graphify(Outer(g.a)), Outer(ref.a)
    with torch.no_grad():
        for _ in range(3):
            x = randn(8, 64)
            ok &= torch.equal(outer(x), outer_ref(x))
        change(g, ref)
        x = randn(8, 64)
        ok_piece = torch.equal(g.a(x), ref.a(x))
        same = all(torch.equal(outer(x), outer_ref(x)) for x in (randn(8, 64) for _ in range(2)))
    check(ok and ok_piece and same,
          f"{tag}: the outer graph sees the change (eager-equal after it)", counters(outer))


def other_wrapper(g, ref):
    g.a.forward = g.b.__dict__["forward"]
    ref.a.forward = ref.b.forward


def other_call_impl(g, ref):
    g.a._compiled_call_impl = g.b._call_impl
    ref.a._compiled_call_impl = ref.b._call_impl


def accelerate(g, ref):
    for m in (g.a, ref.a):
        old = m.forward
        m.forward = functools.update_wrapper(
            functools.partial(lambda mod, x, old=old: old(x) * 2, m), old)


def retired_controls():
    ref, g, ok = root_pair()
    give_back(g.a), give_back(g.b)
    with torch.no_grad():
        for _ in range(3):
            x = randn(8, 64)
            ok &= torch.equal(g(x), ref(x))
    d = g.a.__dict__
    plain = "forward" not in d and type(d["_compiled_call_impl"]) is _watch.PlainCall
    check(ok and plain, "retired pieces (forced): root eager-equal, plain forward and call",
          counters(g.a))
    seen = []
    h = g.a.register_forward_hook(lambda m, i, o: seen.append(1))
    compiled = torch.compile(g, backend="eager")
    with torch.no_grad():
        ok = all(torch.equal(compiled(x), ref(x)) for x in (randn(8, 64) for _ in range(3)))
    h.remove()
    check(ok and len(seen) == 3, "torch.compile(root) with retired pieces and a hook: eager-equal",
          counters(g))
    g.b.compile(backend="eager")
    comp = g.b.__dict__["_compiled_call_impl"]
    with torch.no_grad():
        ok = all(torch.equal(g(x), ref(x)) for x in (randn(8, 64) for _ in range(3)))
    cg.ungraphify(g)
    check(ok and g.b.__dict__.get("_compiled_call_impl") is comp and not _watch.own_call_impl(comp)
          and not any("_cudagraphify_state" in m.__dict__ for m in g.modules()),
          "module.compile() of a retired piece: eager-equal, kept by ungraphify(root)")
    if DEV == "cuda" and torch.cuda.device_count() > 1:
        ref2, g2, ok = root_pair()
        give_back(g2.a)
        dp, dp_ref = nn.DataParallel(g2), nn.DataParallel(ref2)
        with torch.no_grad():
            ok &= all(torch.allclose(dp(x), dp_ref(x)) for x in (randn(16, 64) for _ in range(3)))
        check(ok, "DataParallel over a root with a retired piece: equal eager")
    else:
        print("SKIP DataParallel (one device)")


guarded("R7", lambda: outer_after("R7 a.forward = b's plan wrapper", other_wrapper))
guarded("R8", lambda: outer_after("R8 a._compiled_call_impl = b._call_impl", other_call_impl))
guarded("control accelerate", lambda: outer_after("control accelerate-like hook after the plan",
                                                  accelerate))
guarded("retired controls", retired_controls)
