"""CPU diagnosis (#18, a rehearsal per size): capture_sizes over N sizes of a small capture-aware
model (as HF's masks: a host-sync shortcut when not captured) on the simulated backend of
tests/conftest.py, lending the first size's rehearsal and not. Counts the rehearsals, the probed
runs (warm-up, rehearsal, capture: one probe each) and the eager runs (real calls and
rehearsals), and times the whole (the best of three). Run from the repository root:
``python .ci/diag/sizes_rehearse_cpu.py [N ...]`` (default 8 32)."""
import os, sys, time, warnings
import torch
from torch import nn

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
import cudagraphify as cg  # noqa: E402
from cudagraphify import _capture, _first_call, _probe  # noqa: E402
from conftest import SimBackend  # noqa: E402

warnings.simplefilter("ignore")
print(cg.__file__)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


class Model(nn.Module):
    def __init__(self, layers=16):
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, ids, mask):
        h = self.emb(ids)
        if torch.cuda.is_current_stream_capturing() or not bool(mask.all()):
            h = torch.where(mask[..., None].bool(), h, torch.zeros_like(h))
        for layer in self.layers:
            h = layer(h)
        return h


def run(n: int, lend: bool, quiet: bool = False) -> float:
    sim = SimBackend()
    old = _capture.set_backend(sim)
    real_ask, real_rehearse, real_borrow = (torch.cuda.is_current_stream_capturing,
                                            _first_call.rehearse, _first_call.borrow)
    enter = _probe.Probe.__enter__
    count = {"rehearsals": 0, "probed runs": 0}

    def rehearse(first):
        count["rehearsals"] += 1
        return real_rehearse(first)

    def probed(self):
        count["probed runs"] += 1
        return enter(self)

    torch.cuda.is_current_stream_capturing = lambda: sim.capturing
    _first_call.rehearse, _probe.Probe.__enter__ = rehearse, probed
    if not lend:
        _first_call.borrow = lambda first: None
    try:
        torch.manual_seed(0)
        policy = cg.OpPolicy()
        policy.TRUSTED_CAPTURED_PATHS = (__name__,)
        g = cg.graphify(Model(), op_policy=policy, max_graphs=n)
        sizes = list(range(1, n + 1))
        with torch.no_grad():
            t0 = time.perf_counter()
            done = cg.capture_sizes(g, lambda b: (torch.randint(0, 100, (b, 1)),
                                                  torch.ones(b, 1, dtype=torch.long)),
                                    sizes, progress=False)
            seconds = time.perf_counter() - t0
        if not quiet:
            print(f"{n} sizes, {'lending' if lend else 'not lending'}: {len(done.graphed)} "
                  f"graphed, {count['rehearsals']} rehearsals, {count['probed runs']} probed "
                  f"runs, {sim.warmups} eager runs, {sim.captures} captures")
        return seconds
    finally:
        torch.cuda.is_current_stream_capturing = real_ask
        _first_call.rehearse, _first_call.borrow = real_rehearse, real_borrow
        _probe.Probe.__enter__ = enter
        _capture.set_backend(old)


run(2, True, quiet=True)  # (the first capture pays a one-time cost)
for n in map(int, sys.argv[1:] or ["8", "32"]):
    for lend in (False, True):
        best = min([run(n, lend)] + [run(n, lend, quiet=True) for _ in range(2)])
        print(f"  {best:.2f} s")
