"""lk2 controls on CUDA: the Parameter static copy in training graphs (outputs, x.grad,
w.grad; reused and accumulating; requires_grad flipped; a tensor hook) and no_grad graphs
(returned argument / view, passed twice, in-place writes); Fast with alternating plain,
attributed and Parameter keys. Every line should PASS."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEV, N, D, P, check, finish, rand, skip_without_cuda, stats_line, \
    sync_all, twins  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("b_controls")
import cudagraphify as cg  # noqa: E402
from cudagraphify._fast import Fast  # noqa: E402


def cls(m, x):
    return x * m.w * (2.0 if isinstance(x, nn.Parameter) else 3.0)


def hooked(i):
    p = P(rand(), True)
    p.register_hook(lambda gr: gr * 2)
    return (p,)


TRAIN = {
    "requires grad": (lambda i: (P(rand(), True),), False),
    "reused, grads accumulate": (lambda i: (P(rand(), True),), True),
    "requires_grad flipped": (lambda i: (P(rand(), i % 2 == 0),), False),
    "with a tensor hook": (hooked, False),
}
for label, (make, reuse) in TRAIN.items():
    g, ref = twins(cls)
    ok, pair = True, None
    for i in range(6):
        if pair is None or not reuse:
            torch.manual_seed(10 + i)
            a1 = make(i)
            torch.manual_seed(10 + i)
            a2 = make(i)
            pair = (a1, a2)
        a1, a2 = pair
        o1, o2 = g(*a1), ref(*a2)
        o1.sum().backward()
        o2.sum().backward()
        sync_all()
        ok &= torch.equal(o1.detach(), o2.detach()) and torch.equal(g.w.grad, ref.w.grad)
        for x, y in zip(a1, a2):
            ok &= (x.grad is None) == (y.grad is None) and (x.grad is None
                                                              or torch.equal(x.grad, y.grad))
    check(ok and cg.stats(g).replays >= 3, f"[control] training, Parameter argument {label}",
          stats_line(g))


def one(i):
    return (P(rand()),)


def twice(i):
    p = P(rand())
    return (p, p)


NOGRAD = {
    "returned": (lambda m, x: (cls(m, x), x), one, lambda o, a: o[1] is a[0]),
    "view returned": (lambda m, x: (cls(m, x), x[1:]), one,
                      lambda o, a: o[1].data_ptr() == a[0][1:].data_ptr()),
    "passed twice": (lambda m, x, y: cls(m, x) + y * (2.0 if x is y else 3.0), twice, None),
    "written in place": (lambda m, x: cls(m, x.mul_(2)), one, None),
    "written in place, requires grad": (lambda m, x: cls(m, x.mul_(2)),
                                        lambda i: (P(rand(), True),), None),
}
for label, (body, make, extra) in NOGRAD.items():
    g, ref = twins(body)
    ok = True
    with torch.no_grad():
        for i in range(5):
            torch.manual_seed(10 + i)
            a1 = make(i)
            torch.manual_seed(10 + i)
            a2 = make(i)
            o1, o2 = g(*a1), ref(*a2)
            sync_all()
            t1 = o1 if isinstance(o1, tuple) else (o1,)
            t2 = o2 if isinstance(o2, tuple) else (o2,)
            ok &= all(type(u) is type(v) and torch.equal(u, v) for u, v in zip(t1, t2))
            ok &= all(torch.equal(u, v) for u, v in zip(a1, a2))
            if extra is not None:
                ok &= extra(t1, a1)
    check(ok and cg.stats(g).replays >= 3, f"[control] no_grad, Parameter argument {label}",
          stats_line(g))

g, ref = twins(cls)
ok = True
with torch.no_grad():
    for i in range(12):
        x = rand()
        if i % 3 == 1:
            x.tag = 1
        elif i % 3 == 2:
            x = P(x)
        ok &= torch.equal(g(x), ref(x))
sync_all()
s = cg.stats(g)
check(ok and s.captures == 3 and s.replays == 9
      and type(g._cudagraphify_state._fast) is Fast,
      "[control] Fast: alternating plain, attributed and Parameter keys", stats_line(g))

finish("b_controls")
