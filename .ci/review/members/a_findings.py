"""members review findings on CUDA (segments on, trial off): a member answered whole does not
run its forward's Python, and nothing checks what that Python reads outside modules' instance
attributes, or writes. Each [finding] line FAILs where the finding holds (the member path was
taken: ``whole`` counts the module calls answered whole since the change).
F1 reads: a module global, a class attribute, a closure cell, a function replaced
(F.gelu monkeypatched) [silent]. F2 writes: tensors kept as attributes (an intermediate, the
output), a write-only attribute reset by the user, a global counter [silent state]."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEV, Elem, Host, check, finish, run, skip_without_cuda, twins, untimed, \
    whole, x_of  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

skip_without_cuda("a_findings")
untimed()

SCALE = 2.0


def changed(label, tail, change, undo=None, cls=Elem):
    """Warm (decide, record, 2 replays), ``change()``, 2 more calls compared."""
    torch.manual_seed(0)
    g, ref = twins(Host(cls(tail)))
    x = x_of()
    ok, why = run(g, ref, x, 4)
    before = whole(g)
    if ok:
        change(g, ref)
        try:
            ok, why = run(g, ref, x, 2)
        finally:
            if undo is not None:
                undo()
    check(ok, f"[finding] F1 {label}: outputs as eager's after the change "
          f"(whole before {before}, after {whole(g)})", why)


def set_global(g, ref):
    global SCALE
    SCALE = 5.0


def reset_global():
    global SCALE
    SCALE = 2.0


changed("a module global the member reads changed", lambda m, h: h * SCALE, set_global,
        reset_global)


class ClassAttr(Elem):
    K = 2.0


def set_class(g, ref):
    ClassAttr.K = 5.0


changed("a class attribute the member reads changed", lambda m, h: h * m.K, set_class,
        lambda: setattr(ClassAttr, "K", 2.0), cls=ClassAttr)

cell = [2.0]
changed("a closure cell the member reads changed", lambda m, h: h * cell[0],
        lambda g, ref: cell.__setitem__(0, 5.0))

real_gelu = F.gelu
changed("a function the member calls replaced (F.gelu)", lambda m, h: F.gelu(h),
        lambda g, ref: setattr(F, "gelu", torch.tanh), lambda: setattr(F, "gelu", real_gelu))


# F2: writes
def keeps(m, h):
    m.kept = h * 2
    out = h.relu()
    m.last = out
    return out


torch.manual_seed(0)
g, ref = twins(Host(Elem(keeps)))
ok, why = True, ""
for i in range(6):
    x = torch.randn(8, 64, device=DEV)
    ok, why = run(g, ref, x)
    if not ok:
        break
if ok:
    for name in ("kept", "last"):
        if not torch.equal(getattr(g.inner, name), getattr(ref.inner, name)):
            ok, why = False, f"inner.{name} is not the last call's (stale: the record's)"
            break
check(ok, f"[finding] F2 tensors a member keeps as attributes are the last call's "
      f"(whole {whole(g)})", why)


def flags(m, h):
    m.used = True
    return h


torch.manual_seed(0)
g, ref = twins(Host(Elem(flags)))
x = x_of()
ok, why = run(g, ref, x, 4)
for mod in (g, ref):
    mod.inner.used = False
run(g, ref, x, 1)
ok = ok and g.inner.used == ref.inner.used
check(ok, f"[finding] F2 a write-only attribute reset by the user is set again by the forward "
      f"(whole {whole(g)})", f"graphed used={g.inner.used}, eager used={ref.inner.used}")

HITS = [0]


def counts(m, h):
    HITS[0] += 1
    return h


torch.manual_seed(0)
g, ref = twins(Host(Elem(counts)))
x = x_of()
run(g, ref, x, 4)
before = HITS[0]
with torch.no_grad():
    g(x)
check(HITS[0] == before + 1, f"[finding] F2 a global counter the member's forward bumps counts "
      f"every call (whole {whole(g)})", f"{HITS[0] - before} bumps for one call")

finish("a_findings")
