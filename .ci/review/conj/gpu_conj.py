"""GPU reproductions for the review of ccf92fa (the static copy of a conj or neg view argument
is a conj or neg view itself; CPU versions in tests/test_review_conj.py).

One line per check: ``PASS name`` / ``FAIL name: detail``, then a count. Every output is
compared with eager's bit for bit (``torch.equal``, same kernels, plus dtype, strides and the
conj/neg bits), arguments after the call likewise (writes through the view), aliasing where it
matters (eager's new memory, or the argument's), and each check needs ``cg.stats(g).replays``
to have grown. ``[finding]`` checks FAIL while the finding holds (C1); ``[control]`` ones should
PASS. SKIP and exit 0 without CUDA.
DEV=cpu: a smoke test of this script's own logic on the CPU double of tests/conftest.py.
Run from the repository root: python3 .ci/review/conj/gpu_conj.py
"""
import copy
import os
import sys
import traceback
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

CPU = os.environ.get("DEV", "cuda") == "cpu"
DEV = "cpu" if CPU else "cuda"
warnings.simplefilter("ignore")
if not CPU and not torch.cuda.is_available():
    print("SKIP gpu_conj.py: needs a CUDA GPU (DEV=cpu: a smoke test on the CPU double)")
    sys.exit(0)
if CPU:
    sys.path.insert(1, os.path.join(ROOT, "tests"))
    from conftest import SimBackend  # noqa: E402
    from cudagraphify import _capture as _cap  # noqa: E402

    _cap.set_backend(SimBackend())

import cudagraphify as cg  # noqa: E402

RESULTS = []
_neg = torch._neg_view


def c(*shape):
    return torch.randn(*shape, dtype=torch.complex64, device=DEV)


def r(*shape):
    return torch.randn(*shape, device=DEV)


def sync():
    if not CPU:
        torch.cuda.synchronize()


def replays(g):
    return cg.stats(g).replays


def stats_line(g):
    s = cg.stats(g)
    return (f"captures={s.captures} replays={s.replays} eager={s.eager} "
            f"reasons={[x[:90] for x in s.eager_calls]}")


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


def twin(a):
    """A copy of ``a``'s whole storage viewed as ``a`` is (layout, conj and neg bits)."""
    b, conj, neg = a, a.is_conj(), a.is_neg()
    if conj:
        b = b.conj()
    if neg:
        b = _neg(b)
    t = torch.empty(0, dtype=b.dtype, device=b.device).set_(
        a.untyped_storage().clone(), b.storage_offset(), b.size(), b.stride())
    if neg:
        t = _neg(t)
    if conj:
        t = t.conj()
    return t


def meta(t):
    return (t.shape, t.dtype, t.stride(), t.is_conj(), t.is_neg())


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and meta(a) == meta(b) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def mem(t):
    return t.untyped_storage().data_ptr()


def tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in (x or ()) if isinstance(t, torch.Tensor)]


def loop(g, fn, make, n=4):
    """``g`` and ``fn`` on twins of ``make()`` n times: outputs, arguments after the call and
    which argument each output aliases, as eager's; replays grew. (ok, detail)."""
    before = replays(g)
    with torch.no_grad():
        for i in range(n):
            args = make()
            twins = tuple(twin(a) if isinstance(a, torch.Tensor) else a for a in args)
            got, want = g(*args), fn(*twins)
            sync()
            if not same(got, want):
                gm = [meta(t) for t in tensors(got)]
                wm = [meta(t) for t in tensors(want)]
                return False, f"call {i}: output differs ({gm} vs eager {wm}; {stats_line(g)})"
            for k, (a, b) in enumerate(zip(args, twins)):
                if isinstance(a, torch.Tensor) and not same(a, b):
                    return False, f"call {i}: argument {k} differs from eager's ({stats_line(g)})"
            for o, w in zip(tensors(got), tensors(want)):
                for k, (a, b) in enumerate(zip(args, twins)):
                    if isinstance(a, torch.Tensor) and (mem(o) == mem(a)) != (mem(w) == mem(b)):
                        return False, (f"call {i}: output aliases argument {k}: {mem(o) == mem(a)}"
                                       f", eager's {mem(w) == mem(b)} ({stats_line(g)})")
    if replays(g) <= before:
        return False, f"no replay ({stats_line(g)})"
    return True, ""


# -- [control]: what ccf92fa makes right must equal eager ------------------------------------

CASES = [
    ("resolve_conj of a conj view (new memory, bit resolved)", torch.resolve_conj,
     lambda: (c(8, 64).conj(),)),
    ("resolve_neg of a neg view", torch.resolve_neg, lambda: (_neg(r(8, 64)),)),
    ("resolve_conj of a conj+neg view", torch.resolve_conj, lambda: (_neg(c(8, 64)).conj(),)),
    ("view_as_real(resolve_conj(z)) * 2", lambda z: torch.view_as_real(z.resolve_conj()) * 2,
     lambda: (c(8, 64).conj(),)),
    ("z.imag of a conj view (a neg view) * 2", lambda z: z.imag * 2, lambda: (c(8, 64).conj(),)),
    ("clone of a conj view keeps its bit", torch.clone, lambda: (c(8, 64).conj(),)),
    ("is_conj() branch", lambda z: z * 2 if z.is_conj() else z * 3, lambda: (c(8, 64).conj(),)),
    ("matmul conj @ plain", torch.matmul, lambda: (c(16, 64).conj(), c(64, 32))),
    ("matmul plain @ mH", torch.matmul, lambda: (c(16, 64), c(32, 64).mH)),
    ("fft of a conj view", torch.fft.fft, lambda: (c(8, 64).conj(),)),
    ("rfft of a neg view", torch.fft.rfft, lambda: (_neg(r(8, 64)),)),
    ("returned as is (the caller's conj view)", lambda z: z, lambda: (c(8, 64).conj(),)),
    ("conj() of a conj view (caller's memory, plain)", lambda z: z.conj(),
     lambda: (c(8, 64).conj(),)),
    ("slice of a conj view", lambda z: z[1:3], lambda: (c(8, 64).conj(),)),
    ("strided conj view", torch.resolve_conj, lambda: (c(8, 64)[:, ::2].conj(),)),
    ("transposed conj view", torch.resolve_conj, lambda: (c(64, 8).t().conj(),)),
    ("expanded conj view (compact copy)", torch.resolve_conj,
     lambda: (c(1, 64).conj().expand(8, 64),)),
    ("expanded conj view * 2", lambda z: z * 2, lambda: (c(1, 64).conj().expand(8, 64),)),
    ("the same conj view twice", torch.mul, lambda: (lambda z: (z, z))(c(8, 64).conj())),
    ("z and z.conj()", torch.add, lambda: (lambda z: (z, z.conj()))(c(8, 64))),
    ("mul_ a conj view (writes the caller's base)", torch.Tensor.mul_,
     lambda: (c(8, 64).conj(), c(8, 64))),
    ("add_ 1j to a conj view", lambda z: z.add_(1j), lambda: (c(8, 64).conj(),)),
    ("add_ to a neg view", torch.Tensor.add_, lambda: (_neg(r(8, 64)), r(8, 64))),
    ("add_ to conj(z).imag", lambda z: (z.imag.add_(1), None)[1], lambda: (c(8, 64).conj(),)),
    ("copy_ into a conj view", lambda z, y: z.copy_(y), lambda: (c(8, 64).conj(), c(8, 64))),
    ("out= a conj view", lambda a, b, o: torch.add(a, b, out=o),
     lambda: (c(8, 64), c(8, 64), c(8, 64).conj())),
    ("out= a neg view", lambda a, b, o: torch.add(a, b, out=o),
     lambda: (r(8, 64), r(8, 64), _neg(r(8, 64)))),
]

for _name, _fn, _make in CASES:
    @check(f"[control] {_name}")
    def _(fn=_fn, make=_make):
        return loop(cg.graphify(fn), fn, make)


@check("[control] copy_outputs=False: resolve_conj and (z*2).conj() of a conj view")
def _():
    for fn in (torch.resolve_conj, lambda z: (z * 2).conj()):
        ok, detail = loop(cg.graphify(fn, copy_outputs=False), fn, lambda: (c(8, 64).conj(),))
        if not ok:
            return ok, detail
    return True, ""


@check("[control] complex nn.Linear on a conj view")
def _():
    torch.manual_seed(0)
    m = nn.Linear(64, 32, dtype=torch.complex64, device=DEV)
    ref = copy.deepcopy(m)
    return loop(cg.graphify(m), ref, lambda: (c(8, 64).conj(),))


@check("[control] conj and plain arguments alternating: two graphs, each eager's aliasing")
def _():
    g = cg.graphify(torch.resolve_conj)
    with torch.no_grad():
        for i in range(8):
            z = c(8, 64).conj() if i % 2 else c(8, 64)
            zt = twin(z)
            got, want = g(z), torch.resolve_conj(zt)
            sync()
            if not same(got, want) or (got is z) != (want is zt) \
                    or (mem(got) == mem(z)) != (mem(want) == mem(zt)):
                return False, f"call {i}: differs ({stats_line(g)})"
    s = cg.stats(g)
    return (s.captures, s.replays, s.eager) == (2, 6, 0), stats_line(g)


@check("[control] autograd through a conj view argument (w.conj(), w a leaf): grads eager's")
def _():
    torch.manual_seed(0)
    m = nn.Linear(64, 32, dtype=torch.complex64, device=DEV)
    ref = copy.deepcopy(m)
    g = cg.graphify(m)
    before = replays(g)
    for i in range(4):
        a = c(8, 64).requires_grad_()
        b = a.detach().clone().requires_grad_()
        out, want = g(a.conj()), ref(b.conj())
        gout = c(8, 32)
        (out * gout).real.sum().backward()
        (want * gout).real.sum().backward()
        sync()
        if not torch.equal(out, want) or not torch.equal(a.grad, b.grad) \
                or not torch.equal(m.weight.grad, ref.weight.grad) \
                or not torch.equal(m.bias.grad, ref.bias.grad):
            return False, f"call {i}: outputs or grads differ ({stats_line(g)})"
        m.zero_grad()
        ref.zero_grad()
    return replays(g) > before, stats_line(g)


@check("[control] capture_sizes of conj view arguments, then replays as eager")
def _():
    g = cg.graphify(torch.resolve_conj)
    with torch.no_grad():
        cg.capture_sizes(g, lambda n: (c(n, 64).conj(),), [2, 4], progress=False)
        before = replays(g)
        for n in (2, 4, 2):
            z = c(n, 64).conj()
            got = g(z)
            sync()
            if not same(got, torch.resolve_conj(twin(z))) or mem(got) == mem(z):
                return False, f"size {n}: differs ({stats_line(g)})"
    return replays(g) > before, stats_line(g)


@check("[control] share_graph of complex layers fed a conj view")
def _():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64, dtype=torch.complex64, device=DEV)

        def forward(self, x):
            return self.lin(x.resolve_conj()) * 0.5 + x

    torch.manual_seed(0)
    layers = nn.ModuleList(Layer() for _ in range(3))
    ref = copy.deepcopy(layers)
    cg.share_graph(layers)
    with torch.no_grad():
        for i in range(4):
            x = c(8, 64).conj()
            xt = twin(x)
            for k, (m, e) in enumerate(zip(layers, ref)):
                got, want = m(x), e(xt)
                sync()
                if not same(got, want):
                    return False, f"call {i} layer {k}: differs ({stats_line(m)})"
                x, xt = got.conj(), want.conj()
    reps = [replays(m) for m in layers]
    return all(n > 0 for n in reps), f"replays per layer {reps}"


# -- [finding] C1: a region borrows a conj/neg view of a slot as the plain slot ----------------

for _view in ("conj", "neg"):
    @check(f"[finding] C1 graph_region: g2({_view} view of g1's output) reads the view's values")
    def _(view=_view):
        make = (lambda: r(8, 64)) if view == "neg" else (lambda: c(8, 64))
        bits = _neg if view == "neg" else torch.conj
        f1, f2 = (lambda x: x * 2), (lambda x: x + 1)
        g1, g2 = cg.graphify(f1), cg.graphify(f2)
        with torch.no_grad(), cg.graph_region():
            for i in range(4):
                x = make()
                got = g2(bits(g1(x)))
                want = f2(bits(f1(x)))
                sync()
                if not same(got, want):
                    return False, f"call {i}: the plain slot was read ({stats_line(g2)})"
            n = replays(g2)
        return n > 0, stats_line(g2)


passed = sum(RESULTS)
print(f"{passed} passed, {len(RESULTS) - passed} failed of {len(RESULTS)} "
      f"(the C1 [finding] lines fail while that finding holds)")
