"""Review of d043b8d (a piece's training graph timed against its eager run) on a GPU.

T1 (FAILed on d043b8d; fixed: pending() stays true until the backward returned): TrainingGraph.backward sets ctx.done before it replays its
backward graph, so entry.pending() is False while that backward runs; another thread's grad-mode
call then takes the trial's last eager turn, reaches the verdict (forced here: give back) and
releases the training graph under the backward under way. The other thread's call is made from
inside the backward graph's replay (a wrapper of RawGraph.replay), so the timing is fixed.
Controls (expected PASS), with the real clock: gradient accumulation (two forwards, one
backward) with a no_grad call between forward and backward, through the trial and after it:
outputs equal eager's bitwise, gradients within 1e-5 (a graphed backward's grads may differ
by an ulp: its grad_output is a contiguous copy).
Each line: PASS/FAIL/SKIP and the case. Run on one GPU: ``python trial_train.py``.
(``REVIEW_SIM=1``: a dry run of the script itself on the CPU test double, tests/conftest.py,
with a fake clock; not a GPU result.)
"""
import copy
import os
import sys
import threading
import warnings

import torch
from torch import nn

SIM = os.environ.get("REVIEW_SIM") == "1"
if not torch.cuda.is_available() and not SIM:
    print("SKIP trial_train: needs a CUDA GPU")
    sys.exit(0)

import cudagraphify as cg
from cudagraphify import _capture, _trial

DEV = torch.device("cpu" if SIM else "cuda")
GRAPH = _capture.RawGraph  # the class whose replay is wrapped (T1)
if SIM:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../tests"))
    from conftest import SimBackend, SimGraph
    _backend = SimBackend()
    _fake = [0.0]

    def _tick():
        _fake[0] += 1e-5
        return _fake[0]
    _backend.clock = lambda device: _tick
    _capture.set_backend(_backend)
    GRAPH = SimGraph
    torch.cuda.synchronize = lambda *a: None
warnings.simplefilter("ignore")


class Piece(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.l2(torch.nn.functional.gelu(self.l1(x)))


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Piece(), Piece()

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e30:  # a host sync: piecewise
            y = y + 1
        return self.b(y)


def pair():
    torch.manual_seed(0)
    ref = Root().to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref))


def grads_close(g, ref):
    return all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
               for p, q in zip(g.parameters(), ref.parameters()))


def report(ok, name, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def t1():
    forced = _trial.Trial.verdict
    _trial.Trial.verdict = lambda self: "piece given back: forced by the review"
    replay_attr = GRAPH.__dict__["replay"]
    getter = replay_attr.fget if isinstance(replay_attr, property) \
        else (lambda self: replay_attr.__get__(self))
    armed, errors, threads = [], [], []
    ref, g = pair()

    def other():
        try:
            with torch.enable_grad():
                g(torch.randn(8, 64, device=DEV))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def replay_of(self):
        inner = getter(self)
        st = g.b.__dict__.get("_cudagraphify_state")
        bwd = [getattr(e, "_bwd_raw", None) for e in (st.all_graphs() if st else [])]
        if not armed or not any(self is r for r in bwd):
            return inner

        def run():
            armed.clear()
            t = threading.Thread(target=other)
            t.start()
            # (a moment for it to run inside the backward's window; joined after it)
            t.join(0.3)
            threads.append(t)
            return inner()
        return run

    GRAPH.replay = property(replay_of)
    try:
        for step in range(8):
            x = torch.randn(8, 64, device=DEV)
            o, w = g(x), ref(x)
            if step == 6:  # b's third graph turn; the other call is its third eager turn
                armed.append(True)
            o.sum().backward(), w.sum().backward()
            for t in threads:
                t.join()
            threads.clear()
            if not grads_close(g, ref):
                return report(False, "T1 verdict on another thread during a backward",
                              f"gradients differ at step {step}")
            g.zero_grad(), ref.zero_grad()
        report(not errors, "T1 verdict on another thread during a backward",
               f"other thread raised {errors!r}" if errors else "")
    except Exception as e:  # noqa: BLE001
        report(False, "T1 verdict on another thread during a backward",
               f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        GRAPH.replay = replay_attr
        _trial.Trial.verdict = forced
        torch.cuda.synchronize()


def control(micro):
    ref, g = pair()
    opt_g = torch.optim.SGD(g.parameters(), lr=1e-3)
    opt_r = torch.optim.SGD(ref.parameters(), lr=1e-3)
    try:
        for step in range(24):
            lg = lr = 0
            for k in range(micro):
                x = torch.randn(8, 64, device=DEV)
                o, w = g(x), ref(x)
                if not torch.equal(o, w):
                    return report(False, f"control micro={micro}", f"output at step {step}")
                lg, lr = lg + o.mean(), lr + w.mean()  # (finite over 24 steps)
                if k == 0:
                    with torch.no_grad():
                        x2 = torch.randn(8, 64, device=DEV)
                        if not torch.equal(g(x2), ref(x2)):
                            return report(False, f"control micro={micro}",
                                          f"no_grad output at step {step}")
            lg.backward(), lr.backward()
            if not grads_close(g, ref):
                return report(False, f"control micro={micro}", f"gradients at step {step}")
            # (params equal again: the ulp a graphed backward may differ by does not grow)
            with torch.no_grad():
                for p, q in zip(g.parameters(), ref.parameters()):
                    p.grad.copy_(q.grad)
            opt_g.step(), opt_r.step(), opt_g.zero_grad(), opt_r.zero_grad()
        s = cg.stats(g.a)
        report(True, f"control micro={micro}",
               f"a: replays {s.replays}, timed {s.timed_calls}, graphs {s.graphs}, "
               f"given back: {g.a._cudagraphify_state.given_back}")
    except Exception as e:  # noqa: BLE001
        report(False, f"control micro={micro}", f"{type(e).__name__}: {str(e)[:200]}")


t1()
control(1)
control(2)
