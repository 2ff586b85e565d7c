"""GPU reproductions for the review of 5a18ca2 (``graphify(torch.sin)``: a torch builtin
graphified directly is called through ``_wrap.user_call``; CPU versions in
tests/test_review_usercall.py).

One line per check: ``PASS name`` / ``FAIL name: detail``, then a count. Every output is
compared with eager's bit for bit (``torch.equal``, same kernels), and each check needs
``cg.stats(g).replays`` to have grown. ``[finding]`` checks FAIL while the finding holds
(U1, U4); ``[control]`` ones should PASS. SKIP and exit 0 without CUDA.
DEV=cpu: a smoke test of this script's own logic on the CPU double of tests/conftest.py.
Run from the repository root: python3 .ci/review/usercall/gpu_usercall.py
"""
import copy
import functools
import os
import sys
import traceback
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

CPU = os.environ.get("DEV", "cuda") == "cpu"
DEV = "cpu" if CPU else "cuda"
warnings.simplefilter("ignore")
if not CPU and not torch.cuda.is_available():
    print("SKIP gpu_usercall.py: needs a CUDA GPU (DEV=cpu: a smoke test on the CPU double)")
    sys.exit(0)
if CPU:
    sys.path.insert(1, os.path.join(ROOT, "tests"))
    from conftest import SimBackend  # noqa: E402
    from cudagraphify import _capture as _cap  # noqa: E402

    class _RngSim(SimBackend):  # (its capture leaves the RNG as a CUDA capture does)
        def capture(self, fn, device, pool=None, keep_graph=False):
            state = torch.random.get_rng_state()
            try:
                return super().capture(fn, device, pool, keep_graph)
            finally:
                torch.random.set_rng_state(state)

    _cap.set_backend(_RngSim())

import cudagraphify as cg  # noqa: E402

RESULTS = []


def randn(*shape, **kw):
    return torch.randn(*shape, device=DEV, **kw)


def sync():
    if not CPU:
        torch.cuda.synchronize()


def replays(g):
    return cg.stats(g).replays


def stats_line(g):
    s = cg.stats(g)
    return (f"captures={s.captures} replays={s.replays} eager={s.eager} "
            f"reasons={[r[:90] for r in s.eager_calls]}")


def check(name):
    """Runs ``fn() -> (ok, detail)``; an exception is a FAIL with its message."""
    def run(fn):
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001
            lines = traceback.format_exc().splitlines()
            where = lines[-3].strip()[:120] if len(lines) >= 3 else ""
            ok, detail = False, f"raised {type(e).__name__}: {str(e)[:200]} ({where})"
        sync()
        RESULTS.append(ok)
        print(f"PASS {name}" if ok else f"FAIL {name}: {detail}", flush=True)
        return fn
    return run


def loop(g, make, ref, n=4):
    """Calls ``g`` and ``ref`` on twins of ``make()`` n times: outputs and arguments (written
    in place) equal bit for bit, and replays grew. (ok, detail)."""
    before = replays(g)
    with torch.no_grad():
        for i in range(n):
            args = make()
            twins = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            got = g(*args)
            want = ref(*twins)
            sync()
            if not same(got, want):
                return False, f"call {i}: output differs ({stats_line(g)})"
            for k, (a, b) in enumerate(zip(args, twins)):
                if isinstance(a, torch.Tensor) and not torch.equal(a, b):
                    return False, f"call {i}: argument {k} differs from eager's ({stats_line(g)})"
    if replays(g) <= before:
        return False, f"no replay ({stats_line(g)})"
    return True, ""


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype \
            and a.stride() == b.stride() and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# -- [control]: what 5a18ca2 makes graphed must equal eager ---------------------------------

for _fn, _name in [(torch.sin, "torch.sin"), (F.gelu, "F.gelu"), (torch.Tensor.exp, "Tensor.exp"),
                   (torch.ops.aten.sin.default, "aten.sin.default")]:
    @check(f"[control] {_name} graphified directly replays eager's kernels")
    def _(fn=_fn):
        return loop(cg.graphify(fn), lambda: (randn(8, 64),), fn)


@check("[control] Tensor.add_ / mul_ graphified: the caller's tensor is written, and returned")
def _():
    for fn in (torch.Tensor.add_, torch.Tensor.mul_):
        g = cg.graphify(fn)
        before = replays(g)
        with torch.no_grad():
            for i in range(4):
                x, y = randn(8, 64), randn(8, 64)
                want = fn(x.clone(), y)
                out = g(x, y)
                sync()
                if out is not x or not torch.equal(x, want):
                    return False, f"{fn.__name__} call {i}: input not written as eager " \
                                  f"({stats_line(g)})"
        if replays(g) <= before:
            return False, f"{fn.__name__}: no replay ({stats_line(g)})"
    return True, ""


@check("[control] Tensor.add_ into a column view writes its base")
def _():
    g = cg.graphify(torch.Tensor.add_)
    before = replays(g)
    with torch.no_grad():
        for i in range(4):
            base, y = randn(8, 64), randn(8)
            want = base.clone()
            want[:, 1].add_(y)
            g(base[:, 1], y)
            sync()
            if not torch.equal(base, want):
                return False, f"call {i}: base differs ({stats_line(g)})"
    return replays(g) > before, stats_line(g)


@check("[control] torch.add(out=) and out= a view")
def _():
    g = cg.graphify(torch.add)
    before = replays(g)
    with torch.no_grad():
        for i in range(4):
            x, y = randn(8, 64), randn(8, 64)
            out, base = torch.empty(8, 64, device=DEV), torch.zeros(8, 128, device=DEV)
            r1 = g(x, y, out=out)
            r2 = g(x, y, out=base[:, 32:96])
            want = torch.add(x, y)
            sync()
            if r1 is not out or not torch.equal(out, want) or not torch.equal(r2, want) \
                    or not torch.equal(base[:, 32:96], want) or base[:, :32].any() \
                    or base[:, 96:].any():
                return False, f"call {i}: out= differs ({stats_line(g)})"
    return replays(g) > before, stats_line(g)


for _fn, _args, _same, _name in [
        (torch.Tensor.view, (512,), False, "view"), (torch.Tensor.t, (), False, "t"),
        (torch.Tensor.contiguous, (), True, "contiguous (contiguous input)"),
        (torch.Tensor.float, (), True, "float (float input)"),
        (torch.Tensor.detach, (), False, "detach")]:
    @check(f"[control] Tensor.{_name}: the result aliases the argument as eager's does")
    def _(fn=_fn, args=_args, is_arg=_same):
        g = cg.graphify(fn)
        before = replays(g)
        with torch.no_grad():
            for i in range(4):
                x = randn(8, 64)
                xe = x.clone()
                want = fn(xe, *args)
                r = g(x, *args)
                if not same(r, want) or (r is x) != is_arg or (want is xe) != is_arg:
                    return False, f"call {i}: result differs ({stats_line(g)})"
                r.add_(1)  # (through the result: eager's writes its argument)
                want.add_(1)
                sync()
                if not torch.equal(x, xe):
                    return False, f"call {i}: a write through the result did not reach " \
                                  f"the argument as eagerly ({stats_line(g)})"
        return replays(g) > before, stats_line(g)


@check("[control] torch.split / torch.max(dim=): tuple outputs, views of the argument")
def _():
    gs, gm = cg.graphify(torch.split), cg.graphify(torch.max)
    bs, bm = replays(gs), replays(gm)
    with torch.no_grad():
        for i in range(4):
            x = randn(8, 64)
            parts = gs(x, 4)
            if not same(parts, torch.split(x.clone(), 4)):
                return False, f"split call {i} ({stats_line(gs)})"
            parts[1].zero_()
            m, want = gm(x, dim=1), torch.max(x, dim=1)
            sync()
            if x[4:].any() or type(m) is not type(want) \
                    or not torch.equal(m.values, want.values) \
                    or not torch.equal(m.indices, want.indices):
                return False, f"call {i} ({stats_line(gs)} / {stats_line(gm)})"
    return replays(gs) > bs and replays(gm) > bm, f"{stats_line(gs)} / {stats_line(gm)}"


@check("[control] partial(torch.add, alpha=2.0): its keywords changed in place are seen")
def _():
    p = functools.partial(torch.add, alpha=2.0)
    g = cg.graphify(p)
    x, y = randn(8, 64), randn(8, 64)
    with torch.no_grad():
        for i in range(3):
            if not torch.equal(g(x, y), torch.add(x, y, alpha=2.0)):
                return False, f"call {i} ({stats_line(g)})"
        p.keywords["alpha"] = 3.0
        if not torch.equal(g(x, y), torch.add(x, y, alpha=3.0)):
            return False, f"stale after keywords['alpha'] = 3.0 ({stats_line(g)})"
    return replays(g) >= 2, stats_line(g)


@check("[control] partial(F.pad, pad=list): the list changed in place is seen")
def _():
    pad = [1, 1]
    g = cg.graphify(functools.partial(F.pad, pad=pad))
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                pad[0] = 3
            x = randn(8, 64)
            if not same(g(x), F.pad(x, pad)):
                return False, f"call {i} ({stats_line(g)})"
    return replays(g) >= 2, stats_line(g)


@check("[control] partial(torch.add, other=t): t written in place, .data replaced, set_()")
def _():
    held = randn(8, 64)
    g = cg.graphify(functools.partial(torch.add, other=held))
    with torch.no_grad():
        for i in range(7):
            if i == 3:
                held.add_(1)
            if i == 4:
                held.data = randn(8, 64)
            if i == 5:
                held.set_(randn(8, 64))
            x = randn(8, 64)
            if not torch.equal(g(x), x + held):
                return False, f"call {i} ({stats_line(g)})"
    return replays(g) >= 3, stats_line(g)


@check("[control] seeded torch.rand_like / F.dropout via torch.dropout draw eager's numbers")
def _():
    for fn in (torch.rand_like, functools.partial(torch.dropout, p=0.5, train=True)):
        def run(f):
            torch.manual_seed(0)
            with torch.no_grad():
                outs = [f(torch.ones(8, 64, device=DEV)) for _ in range(5)]
            sync()
            return outs
        want = run(fn)
        g = cg.graphify(fn)
        got = run(g)
        bad = [i for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)]
        if bad or replays(g) < 3:
            return False, f"{getattr(fn, '__name__', 'dropout')}: calls {bad} differ " \
                          f"({stats_line(g)})"
    return True, ""


@check("[control] a graphified builtin's grad mode (sin): gradients equal eager's")
def _():
    g = cg.graphify(torch.sin)
    before = replays(g)
    for i in range(4):
        x = randn(8, 64, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y = g(x)
        y.sum().backward()
        y2 = torch.sin(x2)
        y2.sum().backward()
        sync()
        if not torch.equal(y, y2) or not torch.equal(x.grad, x2.grad):
            return False, f"call {i} ({stats_line(g)})"
    return replays(g) > before, stats_line(g)


# -- [finding] U1: a deep copy loses user_call (runs every call eagerly) ---------------------

@check("[finding] U1 copy.deepcopy(graphify(torch.sin)) replays")
def _():
    return loop(copy.deepcopy(cg.graphify(torch.sin)), lambda: (randn(8, 64),), torch.sin)


class _Act(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.act = cg.graphify(F.gelu)

    def forward(self, x):
        return self.act(self.lin(x))


@check("[finding] U1 a deep-copied module's graphify(F.gelu) attribute replays")
def _():
    m = copy.deepcopy(_Act().to(DEV))
    return loop(m.act, lambda: (randn(8, 64),), F.gelu)


# -- [finding] U4: a partial's __setstate__ swaps what it calls: the graph goes stale --------

@check("[finding] U4 partial(torch.add).__setstate__ to torch.sub is not replayed as add")
def _():
    p = functools.partial(torch.add, alpha=2.0)
    g = cg.graphify(p)
    x, y = randn(8, 64), randn(8, 64)
    with torch.no_grad():
        for _ in range(3):
            g(x, y)
        p.__setstate__((torch.sub, (), p.keywords, None))
        got, want = g(x, y), torch.sub(x, y, alpha=2.0)
        sync()
    return torch.equal(got, want), f"stale: the add graph replayed ({stats_line(g)})"


@check("[finding] U4 partial.__setstate__ with a new keywords dict (alpha 2 -> 3) is seen")
def _():
    p = functools.partial(torch.add, alpha=2.0)
    g = cg.graphify(p)
    x, y = randn(8, 64), randn(8, 64)
    with torch.no_grad():
        for _ in range(3):
            g(x, y)
        p.__setstate__((torch.add, (), {"alpha": 3.0}, None))
        got, want = g(x, y), torch.add(x, y, alpha=3.0)
        sync()
    return torch.equal(got, want), f"stale: alpha=2.0 replayed ({stats_line(g)})"


passed = sum(RESULTS)
print(f"{passed} passed, {len(RESULTS) - passed} failed of {len(RESULTS)} "
      f"(U1 and U4 [finding] lines fail while those findings hold)")
