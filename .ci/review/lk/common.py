"""Shared bits of the leaf-kind review's GPU scripts (of 726d373: a tensor leaf's class and
whether it carries Python attributes are in the key, ``_signature.leaf_kind``; the fast path
hands attributed calls to the slow path; CPU reproductions in tests/test_review_lk.py).

The helpers are hunt 8d's (../hunt8d/common.py, itself loading ../callables/common.py),
loaded under a name of their own: one line per check, ``PASS ...`` / ``FAIL ...: why``
(``INFO`` for numbers), ``SKIP`` and exit 0 without CUDA; ``[finding]`` lines FAIL where the
finding holds, ``[control]`` lines should PASS. DEV=cpu: a smoke test on the CPU double of
tests/conftest.py.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("review_hunt8d_common", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "hunt8d", "common.py"))
_h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_h)
CPU, DEV, D, N = _h.CPU, _h.DEV, _h.D, _h.N
Flat, Inner, Net = _h.Flat, _h.Inner, _h.Net
calls, check, finish, info, rand = _h.calls, _h.check, _h.finish, _h.info, _h.rand
same, skip_without_cuda, stats_line, sync_all, twins = \
    _h.same, _h.skip_without_cuda, _h.stats_line, _h.sync_all, _h.twins

from torch import nn  # noqa: E402


def param(i):
    """A Parameter argument the module does not own (every call: one key)."""
    return (nn.Parameter(rand(), requires_grad=False),), {}


def all_equal(g, res) -> bool:
    import cudagraphify as cg
    return all(o for o, _ in res) and cg.stats(g).replays >= 1
