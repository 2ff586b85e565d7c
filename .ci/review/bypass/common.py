"""Shared bits of the review scripts of f9e7252 (a piece's training graph's timed turns count
the slow path from ``GraphedState.slow()`` on) and a8abf78 (``_fast.Bypass``: a piecewise
root's grad-mode calls run its pending pieces plain from their DirectCall). CPU findings and
controls: tests/test_review_bypass.py.

DEV (env, default "cuda"): the device. DEV=cpu (or no CUDA device) runs the CPU double of
tests/conftest.py (the simulated capture backend): a smoke test of the scripts themselves, not a
GPU result. One line per check: PASS / FAIL (with numbers), INFO for what is only reported.
[finding] lines FAIL on the code reviewed; [control] lines PASS. Every script exits 0."""
import contextlib
import copy
import os
import sys
import warnings

import torch

from cudagraphify import _capture, _fast

warnings.simplefilter("ignore")

DEV = os.environ.get("DEV", "cuda")
if DEV.startswith("cuda") and not torch.cuda.is_available():
    print("INFO no CUDA device: DEV=cpu (the CPU double; not a GPU result)", flush=True)
    DEV = "cpu"
CPU = DEV == "cpu"
_HERE = os.path.dirname(os.path.abspath(__file__))
if CPU:
    sys.path.insert(0, os.path.join(_HERE, "..", "..", "..", "tests"))
    from conftest import SimBackend
    _capture.set_backend(SimBackend())
    torch.set_num_threads(1)
# no piece trial by default (it decides on the machine's speed: a piece given back has no
# pending graph to bypass); timed() puts the clock back for the cases that want it
CLOCK = _capture.CudaBackend.clock
_capture.CudaBackend.clock = None
STATE = "_cudagraphify_state"
PENDING = __import__("cudagraphify._engine", fromlist=["PENDING"]).PENDING

FAILS = []


def check(ok, what, detail=""):
    if not ok:
        FAILS.append(what)
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)


def info(what):
    print(f"INFO {what}", flush=True)


def skip(what, why):
    print(f"SKIP {what}: {why}", flush=True)


@contextlib.contextmanager
def bypass_off():
    """As before a8abf78: no root arms a bypass (each piece through its own pending path)."""
    scan = _fast.Bypass.scan
    _fast.Bypass.scan = staticmethod(lambda state: None)
    try:
        yield
    finally:
        _fast.Bypass.scan = scan


@contextlib.contextmanager
def timed():
    """The pieces' trial on (the CUDA clock; the CPU double gets a host clock)."""
    if CPU:
        import time
        backend = _capture.default_backend()
        backend.clock = lambda device: time.perf_counter
        try:
            yield
        finally:
            del backend.clock
        return
    _capture.CudaBackend.clock = CLOCK
    try:
        yield
    finally:
        _capture.CudaBackend.clock = None


def armed(g) -> bool:
    st = g.__dict__.get(STATE)
    return getattr(getattr(st, "_fast", None), "bypass", None) is not None


def grads(m):
    return [None if p.grad is None else p.grad.detach().clone() for p in m.parameters()]


def same_grads(a, b) -> bool:
    return all((x is None) == (y is None) and (x is None or torch.equal(x, y))
               for x, y in zip(a, b))


def max_diff(a, b) -> float:
    return max([0.0] + [(x.double() - y.double()).abs().max().item()
                        for x, y in zip(a, b) if x is not None and y is not None])


def zero(*mods):
    for m in mods:
        m.zero_grad(set_to_none=True)


def pieces_of(g) -> list:
    st = g.__dict__.get(STATE)
    return list(st.pieces) if st is not None else []


def pending_calls(mods) -> int:
    import cudagraphify as cg
    return sum(cg.stats(m).eager_calls.get(PENDING, 0) for m in mods)


def differential(name, make, inputs, out=lambda o: o, train_steps=5, first=6, later=4):
    """One model three ways: graphified with the bypass (``on``), graphified with it off
    (``off``), eager (``ref``), plus an eager twin (``ref2``: is eager itself bitwise
    reproducible here?). Training steps, then grad-mode calls with every output kept (the
    bypass arms on ``on``), then more kept calls (every piece plain on ``on``) and their
    backward alone, then the first kept calls' backward. Outputs bitwise eager's throughout;
    the gradients of the calls made while armed bitwise eager's; ``on`` bitwise ``off``."""
    import cudagraphify as cg
    torch.manual_seed(0)
    ref = make().to(DEV)
    ref2 = copy.deepcopy(ref)
    on, off = cg.graphify(copy.deepcopy(ref)), cg.graphify(copy.deepcopy(ref))
    models = (on, off, ref, ref2)
    it = iter(inputs)
    ok_out = [True]  # every output bitwise eager's
    graphs_agree = [True]  # on's and off's bitwise each other's, the eager twins' likewise
    worst = [0.0]  # the largest |diff| of a graphed output from eager's

    def call(back):
        x = next(it)
        outs = [None] * 4
        outs[0] = out(on(*x[0], **x[1]))
        with bypass_off():
            outs[1] = out(off(*x[0], **x[1]))
        outs[2] = out(ref(*x[0], **x[1]))
        outs[3] = out(ref2(*x[0], **x[1]))
        if not all(torch.equal(o, outs[2]) for o in outs):
            ok_out[0] = False
            worst[0] = max(worst[0], max_diff(outs[0], outs[2]), max_diff(outs[1], outs[2]))
        if not (torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])):
            graphs_agree[0] = False
        if back:
            for o in outs:
                o.float().sum().backward()
        return outs

    try:
        for _ in range(train_steps):
            call(True)
        g = [grads(m) for m in models]
        det = same_grads(g[2], g[3])
        info(f"{name}: eager bitwise reproducible here (gradients): {det}")
        check(same_grads(g[0], g[1]), f"[control] {name}: training steps, gradients with the "
              "bypass on bitwise those with it off")
        if same_grads(g[0], g[2]) or not det:
            check(True, f"[control] {name}: training steps, gradients bitwise eager's")
        else:  # (before any bypass: the graphed backward's own rounding, on and off alike)
            info(f"{name}: training steps, graphed gradients vs eager max |diff| "
                 f"{max_diff(g[0], g[2]):.3g} (no bypass armed yet: the graphed backward's "
                 "own rounding, bypass on bitwise off above)")
        zero(*models)
        kept1 = [call(False) for _ in range(first)]
        if not armed(on):
            skip(f"{name}: bypass checks", f"no bypass armed ({len(pieces_of(on))} pieces; "
                 f"root decision {type(getattr(on.__dict__.get(STATE), '_fast', None)).__name__})")
        else:
            info(f"{name}: bypass armed, {len(pieces_of(on))} pieces")
        check(not armed(off), f"[control] {name}: no bypass with it off")
        before = pending_calls(pieces_of(on))
        kept2 = [call(False) for _ in range(later)]
        info(f"{name}: piece calls counted pending in {later} armed calls: "
             f"{pending_calls(pieces_of(on)) - before}")
        for i, m in enumerate(models):
            sum(k[i].float().sum() for k in kept2).backward()
        g = [grads(m) for m in models]
        check(same_grads(g[0], g[2]) or not det, f"[control] {name}: backward of the calls "
              "made while armed (every piece plain): gradients bitwise eager's",
              f"max |diff| {max_diff(g[0], g[2]):.3g}")
        check(same_grads(g[0], g[1]), f"[control] {name}: same, bypass on bitwise off")
        zero(*models)
        for i, m in enumerate(models):
            sum(k[i].float().sum() for k in kept1).backward()
        g = [grads(m) for m in models]
        check(same_grads(g[0], g[1]), f"[control] {name}: backward of the first kept calls "
              "(graphs replayed among them), bypass on bitwise off")
        if same_grads(g[0], g[2]):
            check(True, f"[control] {name}: same, bitwise eager's")
        else:
            info(f"{name}: backward of the first kept calls, graphed vs eager max |diff| "
                 f"{max_diff(g[0], g[2]):.3g} (graphed backwards may differ by an ulp, with or "
                 "without the bypass: see the line above)")
        zero(*models)
        for _ in range(3):
            call(True)
        g = [grads(m) for m in models]
        check(same_grads(g[0], g[1]), f"[control] {name}: training after, on bitwise off")
        if ok_out[0] or not graphs_agree[0]:
            check(ok_out[0], f"[control] {name}: every output bitwise eager's (on, off, twin)")
        else:  # (a piece whose captured path differs from eager's: HF's mask code, below)
            info(f"{name}: graphed outputs vs eager max |diff| {worst[0]:.3g} (a small fp32 "
                 "HF Llama's logits from a hand-made torch.cuda.graph differ from eager's by "
                 "about 1e-7 too, .ci/diag/llama_bitwise.py on the H200: HF's code takes "
                 "another path while captured)")
            check(worst[0] < 1e-5, f"[control] {name}: every output bitwise on's = off's, "
                  "the eager twins' each other's, and within 1e-5 of eager's",
                  f"max |diff| {worst[0]:.3g}")
    except Exception as e:  # noqa: BLE001
        check(False, f"[control] {name}", f"{type(e).__name__}: {str(e)[:300]}")
