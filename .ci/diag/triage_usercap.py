"""Triage of the GPU-only FAILs of .ci/review/usercapture (A's own capture fails while B calls)
and .ci/review/retire (pending backward: grads not bitwise). Each scenario in its own process."""
import copy
import subprocess
import sys
import threading
import traceback
import warnings

import torch
from torch import nn

warnings.simplefilter("ignore")
DIM = 256


def race(b_kind, a_kind):
    """A: user's thread_local capture (own stream) of a_kind's call; B meanwhile calls b_kind
    on its own stream with inputs made beforehand. kinds: eager | graphify | graphify_eager."""
    import cudagraphify as cg
    from cudagraphify import _capture
    _capture.CudaBackend.clock = None
    torch.manual_seed(0)
    lin = nn.Linear(DIM, DIM).cuda()
    models = {"eager": lin, "graphify": cg.graphify(copy.deepcopy(lin))}
    ma, mb = models[a_kind], models[b_kind] if b_kind != "other" else nn.Linear(DIM, DIM).cuda()
    if b_kind == "graphify_other":
        mb = cg.graphify(nn.Linear(DIM, DIM).cuda())
    s, sb = torch.cuda.Stream(), torch.cuda.Stream()
    xa, xb = torch.randn(8, DIM, device="cuda"), torch.randn(8, DIM, device="cuda")
    inside, done, err = threading.Event(), threading.Event(), {}
    with torch.no_grad():
        for m in (ma, mb):
            for st in (s, sb):
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    for _ in range(3):
                        m(xa)
        torch.cuda.synchronize()

    def a():
        try:
            with torch.no_grad():
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, capture_error_mode="thread_local"):
                    ma(xa)
                    inside.set()
                    done.wait(5)
        except BaseException as e:  # noqa: BLE001
            err["A"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            traceback.print_exc()
        finally:
            inside.set()

    def b():
        inside.wait(5)
        try:
            with torch.no_grad(), torch.cuda.stream(sb):
                mb(xb)
        except BaseException as e:  # noqa: BLE001
            err["B"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            traceback.print_exc()
        finally:
            done.set()

    log = []
    if b_kind.startswith("graphify"):
        # what B's call asks of CUDA, as cudagraphify's backend methods see it
        be = type(_capture.default_backend())
        for name in ("order_after", "drain", "drain_all", "warmup", "capture", "clock",
                     "stream_capturing"):
            fn = getattr(be, name)

            def traced(self, *a, _fn=fn, _name=name, **k):
                r = _fn(self, *a, **k)
                if threading.current_thread().name == "B":
                    log.append(f"{_name}{a} -> {r!r}"[:120])
                return r
            setattr(be, name, traced)
        sync = torch.cuda.synchronize

        def tsync(*a, **k):
            if threading.current_thread().name == "B":
                log.append("torch.cuda.synchronize")
            return sync(*a, **k)
        torch.cuda.synchronize = tsync
    ts = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    stats = ""
    if b_kind.startswith("graphify"):
        st = cg.stats(mb)
        stats = f" B stats: captures={st.captures} replays={st.replays} eager={dict(st.eager_calls)}"
    print(f"RACE A={a_kind} B={b_kind}: {err or 'ok'}{stats} B's backend calls: {log}",
          flush=True)


def grads():
    import cudagraphify as cg
    from cudagraphify import _trial
    _trial.PLAN_TRIAL = False
    _trial.Trial.verdict = lambda self: None

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            y = self.a(x)
            if bool((y > -1e9).all()):
                y = y + 1
            return self.b(y)

    for kind in ("Linear whole", "Root pieces"):
        torch.manual_seed(0)
        ref = (nn.Linear(64, 64) if kind.startswith("Linear") else Root()).cuda()
        g = cg.graphify(copy.deepcopy(ref))
        for step in range(6):
            x = torch.randn(8, 64, device="cuda")
            g.zero_grad(), ref.zero_grad()
            o, w = g(x), ref(x)
            o.sum().backward(), w.sum().backward()
            d = [float((p.grad - q.grad).abs().max()) for p, q in zip(g.parameters(), ref.parameters())]
            print(f"GRADS {kind} step {step}: out equal {torch.equal(o, w)}, grad max|diff| {d}; "
                  f"replays {cg.stats(g).replays}", flush=True)


SCEN = {
    "eager_eager": lambda: race("other", "eager"),
    "A_graphify_B_eager": lambda: race("other", "graphify"),
    "A_eager_B_graphify_other": lambda: race("graphify_other", "eager"),
    "A_graphify_B_graphify_same": lambda: race("graphify", "graphify"),
    "grads": grads,
}
if len(sys.argv) > 1:
    SCEN[sys.argv[1]]()
else:
    for name in SCEN:
        r = subprocess.run([sys.executable, sys.argv[0], name], capture_output=True, text=True,
                           timeout=60)
        print(r.stdout, end="")
        if r.returncode or "Error" in r.stdout:
            print("  stderr tail:", "\n  ".join(r.stderr.strip().splitlines()[-12:]))
