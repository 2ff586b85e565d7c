"""Shared bits of the lk2 review's GPU scripts (of 726d373..1139dfc: leaf kind in the key; a
copied nn.Parameter's static copy is a Parameter on the same memory; CPU reproductions in
tests/test_review_lk2.py). The helpers are the lk review's (../lk/common.py, itself loading
../hunt8d/common.py), loaded under a name of their own: one line per check, ``PASS ...`` /
``FAIL ...: why``; ``[finding]`` lines FAIL where the finding holds, ``[control]`` lines should
PASS; SKIP and exit 0 without CUDA. DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("review_lk_common", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "lk", "common.py"))
_h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_h)
CPU, DEV, D, N = _h.CPU, _h.DEV, _h.D, _h.N
check, finish, info, rand, same = _h.check, _h.finish, _h.info, _h.rand, _h.same
skip_without_cuda, stats_line, sync_all = _h.skip_without_cuda, _h.stats_line, _h.sync_all

import torch  # noqa: E402
from torch import nn  # noqa: E402


def P(t, rg=False):
    return nn.Parameter(t, requires_grad=rg)


class W(nn.Module):
    """``body(self, *args)`` with one parameter ``w`` of D."""

    def __init__(self, body):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.body = body

    def forward(self, *args):
        return self.body(self, *args)


def twins(body, **kw):
    import copy
    import cudagraphify as cg
    torch.manual_seed(0)
    ref = W(body).to(DEV)
    return cg.graphify(copy.deepcopy(ref), **kw), ref
