"""Hunt-8c review on CUDA, L1: a Triton kernel launched on an ARGUMENT. Triton's launcher (and
its specialization on ``data_ptr() % 16``) read the argument's ``data_ptr`` from Triton's own
files; ``_probe._reader_is_torch`` trusts torch's files only, so since 3ca76f2 the module is
refused (PYTHON_STATE) where it was graphed, though the pointer only feeds the kernel: a
replay launches it on the static copy it was specialised and launched for. Checked against
the same run with ``Probe.read_metadata`` off (the change's addition), and on a misaligned
later argument (the replay copies it into the aligned static copy: still eager's values)."""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, DEV, check, finish, info, same, skip_without_cuda, stats_line, \
    sync_all  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("c_triton")
if CPU:
    print("SKIP c_triton: a Triton kernel needs CUDA", flush=True)
    sys.exit(0)
try:
    import triton
    import triton.language as tl
except ImportError as e:
    print(f"SKIP c_triton: no triton ({e})", flush=True)
    sys.exit(0)
import cudagraphify as cg  # noqa: E402
from cudagraphify import _probe  # noqa: E402

info(f"triton {triton.__version__}, torch {torch.__version__}")


@triton.jit
def double(src, dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst + i, tl.load(src + i, mask=m) * 2.0, mask=m)


def launch(t):
    out = torch.empty_like(t)
    double[(triton.cdiv(t.numel(), 1024),)](t, out, t.numel(), BLOCK=1024)
    return out


class OnArgument(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64))

    def forward(self, x):
        return launch(x) * self.w + 1  # (the kernel reads the argument itself)


class OnMade(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64))

    def forward(self, x):
        return launch(x + 0.0) * self.w + 1  # (the kernel reads a tensor the forward made)


def fresh():
    return torch.randn(8, 64, device=DEV)


def misaligned():
    return torch.randn(8 * 64 + 1, device=DEV)[1:].view(8, 64)


def run(make):
    torch.manual_seed(0)
    ref = make().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    ok, why = True, ""
    with torch.no_grad():
        for i in range(6):
            x = fresh() if i < 4 else misaligned()
            a, b = g(x), ref(x)
            sync_all()
            ok, why = same(a, b)
            if not ok:
                why = f"call {i}: {why}"
                break
    s = cg.stats(g)
    return ok, s, why or stats_line(g)


real = _probe.Probe.read_metadata
ok, s, why = run(OnArgument)
reasons = list(s.eager_calls)
check(ok and s.replays >= 5 and not reasons,
      "[finding] L1 a Triton kernel on the argument stays graphed (as before the change)", why)
for r in reasons:
    info(f"L1 reason: {r[:200]}")

_probe.Probe.read_metadata = lambda self, name, args: None  # (as before 3ca76f2)
ok, s, why = run(OnArgument)
_probe.Probe.read_metadata = real
check(ok and s.replays >= 5 and not s.eager_calls,
      "[control] L1 with Probe.read_metadata off (before the change): graphed, eager's values "
      "(misaligned later arguments included)", why)

ok, s, why = run(OnMade)
check(ok and s.replays >= 5 and not s.eager_calls,
      "[control] a Triton kernel on a tensor the forward made: graphed", why)

finish("c_triton")
