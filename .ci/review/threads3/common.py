"""Shared bits of the review scripts of 6c0e2ee/32c964b (one warm-up/capture side stream per
device AND thread, ``CudaBackend._side_stream`` keyed through a ``threading.local``).

The fix relies on "the thread that ran a first call's forward is the only one that can be
capturing on the stream that call's backward runs on". These scripts test where that does not
hold (``[finding]`` lines: FAIL on the code reviewed, on a GPU) next to controls that show the
fixed case passes (``[control]`` lines: PASS). ``[cost]`` lines measure a price of the change.

Every script: one line per check, ``PASS ...`` / ``FAIL ...: why`` (``INFO`` for numbers),
deterministic through threading.Events where two threads must overlap, compares every value
with an eager twin (torch.equal where the same kernels run, allclose for gradients of
separately run backwards), and prints ``SKIP`` and exits 0 without CUDA.
"""
import copy
import os
import sys
import threading
import warnings

import torch
import torch.nn.functional as F
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)


# DEV=cpu: a smoke test of the scripts' own logic on the CPU double of tests/conftest.py (the
# simulated capture backend: no streams, so every [finding] passes there by construction)
CPU = os.environ.get("DEV", "cuda") == "cpu"
DEV = "cpu" if CPU else "cuda"


def skip_without_cuda(name: str) -> None:
    if not CPU and not torch.cuda.is_available():
        print(f"SKIP {name}: needs a CUDA GPU (DEV=cpu: a smoke test on the CPU double)",
              flush=True)
        sys.exit(0)


warnings.simplefilter("ignore")
W, B = 256, 32
FAILS: list = []

if CPU:
    sys.path.insert(1, os.path.join(ROOT, "tests"))
    from conftest import SimBackend  # noqa: E402
    from cudagraphify import _capture as _cap  # noqa: E402
    _cap.set_backend(SimBackend())
    torch.set_num_threads(1)


def _capturing_now() -> bool:
    """This thread's stream is being captured. The C query, not
    torch.cuda.is_current_stream_capturing: the op probe wraps that one (and counts the module
    as capture-aware); this one it does not see."""
    if CPU:
        return backend().capturing
    return torch._C._cuda_isCurrentStreamCapturing()


def sync() -> None:
    """This thread's current stream done (nothing on the CPU double)."""
    if not CPU:
        torch.cuda.current_stream().synchronize()


def sync_all() -> None:
    if not CPU:
        torch.cuda.synchronize()


def check(ok: bool, what: str, detail: str = "") -> None:
    if not ok:
        FAILS.append(what)
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail and not ok else ""),
          flush=True)


def info(what: str) -> None:
    print(f"INFO {what}", flush=True)


def backend():
    from cudagraphify import _capture
    return _capture.default_backend()


_fake = threading.local()
_fake_next = [0]
_fake_lock = threading.Lock()


def side_token() -> int:
    """This thread's cudagraphify side stream (made now if this thread has none yet). On the
    CPU double: a stand-in that takes torch's pool's turn (32 streams, round robin)."""
    if CPU:
        tok = getattr(_fake, "tok", None)
        if tok is None:
            with _fake_lock:
                tok = _fake.tok = 0x1000 + (_fake_next[0] % 32)
                _fake_next[0] += 1
        return tok
    dev = torch.device(DEV, torch.cuda.current_device())
    return backend()._side_stream(dev).cuda_stream


class Net(nn.Module):
    """Linear -> GELU -> Linear."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


# id(module) -> (reached, release): a Gated module's capture (its first) sets ``reached`` and
# waits for ``release`` (kept outside the module: no attribute of it changes)
GATES: dict = {}


class Gated(nn.Module):
    """Linear -> ReLU whose first capture (with a gate armed) signals and waits: another thread
    then runs while this one captures."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x):
        h = self.fc(x)
        gate = GATES.get(id(self))
        if gate is not None and _capturing_now():
            reached, release = gate
            if not reached.is_set():
                reached.set()
                release.wait(10)
        return torch.relu(h)


def arm(module) -> tuple:
    gate = GATES[id(module)] = (threading.Event(), threading.Event())
    return gate


def disarm(module) -> None:
    GATES.pop(id(module), None)


def pair(cls, seed: int = 0):
    """An eager module and a graphified deep copy of it, on the GPU."""
    import cudagraphify as cg
    torch.manual_seed(seed)
    ref = cls().to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref))


def x_(*shape, **kw) -> torch.Tensor:
    return torch.randn(*(shape or (B, W)), device=DEV, **kw)


def zero_grads(*modules) -> None:
    """``.grad`` set to zeros: a later accumulation is an in-place add (a kernel on the
    AccumulateGrad node's stream), which a backward swallowed by a capture would not run."""
    for m in modules:
        for p in m.parameters():
            p.grad = torch.zeros_like(p)


def grads_close(got_params, want_params, rtol=1e-4, atol=1e-5) -> str:
    """Empty when every gradient (a parameter's ``.grad``, or one kept aside by :func:`kept`) is
    close to the eager twin's, else why not."""
    for k, (p, q) in enumerate(zip(got_params, want_params)):
        g = p.value if isinstance(p, _Grad) else p.grad
        if g is None:
            return f"gradient {k} is missing"
        if q.grad is None:
            return f"eager gradient {k} is missing"
        if not torch.allclose(g, q.grad, rtol=rtol, atol=atol):
            return (f"gradient {k} differs from eager's (max abs diff "
                    f"{(g - q.grad).abs().max().item():.3g}, |eager| max "
                    f"{q.grad.abs().max().item():.3g})")
    return ""


class _Grad:
    """A gradient kept aside (a clone), compared as a parameter's ``.grad`` would be."""

    def __init__(self, value):
        self.value = value


def kept(params) -> list:
    return [_Grad(None if p.grad is None else p.grad.clone()) for p in params]


def calls_match(ref, graphed, n: int = 3, grad: bool = False) -> str:
    """Empty when ``n`` more calls (no_grad; with ``grad``, forward and backward) give eager's
    outputs (bitwise) and gradients (close), else why not."""
    for i in range(n):
        x = x_()
        if grad:
            zero_grads(ref, graphed)
            got, want = graphed(x), ref(x)
            if not torch.equal(got, want):
                return f"call {i}: output differs from eager's"
            got.sum().backward()
            want.sum().backward()
            why = grads_close(list(graphed.parameters()), list(ref.parameters()))
            if why:
                return f"call {i}: {why}"
        else:
            with torch.no_grad():
                got, want = graphed(x), ref(x)
            if not torch.equal(got, want):
                return f"call {i}: output differs from eager's"
    return ""


def first_error(errors: list) -> str:
    if not errors:
        return ""
    who, e = errors[0]
    return f"{who}: {type(e).__name__}: {str(e).strip().splitlines()[0][:180] if str(e).strip() else ''}"


def finish(name: str) -> None:
    sync_all()
    if CPU:
        info("CPU double: no streams, the [finding] lines pass there by construction")
    info(f"{name}: {len(FAILS)} FAIL line(s)")
