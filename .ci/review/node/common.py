"""Shared bits of the review scripts of 9dddd85/99d7faa (a first call's real call on the
caller's stream, ``CudaBackend.warmup(on_side=False)``; side streams primed with small matmuls
for cuBLAS/cuBLASLt workspaces, ``CudaBackend._side_stream``) and bd9c6ad (CPU-tested in
tests/test_review_node.py).

Every script: one line per check, ``PASS ...`` / ``FAIL ...: why`` (``INFO`` for numbers),
values compared with an eager twin (torch.equal where the same kernels run: forward outputs;
allclose for gradients of separately run backwards), ``SKIP`` and exit 0 without CUDA.
DEV=cpu: a smoke test of the scripts' own logic on the CPU double of tests/conftest.py (no
streams: the stream-specific checks say SKIP there).
"""
import copy
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

CPU = os.environ.get("DEV", "cuda") == "cpu"
DEV = "cpu" if CPU else "cuda"
warnings.simplefilter("ignore")
W, B = 256, 32
FAILS: list = []


def skip_without_cuda(name: str) -> None:
    if not CPU and not torch.cuda.is_available():
        print(f"SKIP {name}: needs a CUDA GPU (DEV=cpu: a smoke test on the CPU double)",
              flush=True)
        sys.exit(0)


if CPU:
    sys.path.insert(1, os.path.join(ROOT, "tests"))
    from conftest import SimBackend  # noqa: E402
    from cudagraphify import _capture as _cap  # noqa: E402
    _cap.set_backend(SimBackend())
    torch.set_num_threads(1)


def check(ok: bool, what: str, detail: str = "") -> None:
    if not ok:
        FAILS.append(what)
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail and not ok else ""),
          flush=True)


def info(what: str) -> None:
    print(f"INFO {what}", flush=True)


def sync_all() -> None:
    if not CPU:
        torch.cuda.synchronize()


def backend():
    from cudagraphify import _capture
    return _capture.default_backend()


class Net(nn.Module):
    """Linear -> GELU -> Linear."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def pair(cls, seed: int = 0, **options):
    import cudagraphify as cg
    torch.manual_seed(seed)
    ref = cls().to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref), **options)


def x_(*shape, **kw) -> torch.Tensor:
    return torch.randn(*(shape or (B, W)), device=DEV, **kw)


def grads_close(got, want, rtol=1e-4, atol=1e-5) -> str:
    for k, (p, q) in enumerate(zip(got.parameters(), want.parameters())):
        if (p.grad is None) != (q.grad is None):
            return f"gradient {k}: present on one side only"
        if p.grad is not None and not torch.allclose(p.grad, q.grad, rtol=rtol, atol=atol):
            return f"gradient {k} differs (max abs {(p.grad - q.grad).abs().max().item():.3g})"
    return ""


def stats_line(g) -> str:
    import cudagraphify as cg
    s = cg.stats(g)
    return (f"captures={s.captures} replays={s.replays} eager={s.eager} "
            f"pool={s.graph_pool_bytes} reasons={[r[:120] for r in s.eager_calls]}")


def finish(name: str) -> None:
    sync_all()
    info(f"{name}: {len(FAILS)} FAIL line(s)")
