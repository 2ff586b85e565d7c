"""Shared bits of the grow review's GPU scripts (c213750: a region slot's memory checked as a
copy_outputs=False output's, an alias grown in place making its graph eager for good; CPU
reproductions in tests/test_review_grow.py).

Every script: one line per check, ``PASS ...`` / ``FAIL ...: why`` (``INFO`` for numbers),
compared with an eager twin (torch.equal where the same kernels run), ``SKIP`` and exit 0
without CUDA. ``[finding]`` lines FAIL where the finding holds; ``[control]`` lines should PASS.
On the CPU double (DEV=cpu, a smoke test of the scripts' own logic) a replay reading memory that
moved raises an AssertionError ("stale replay"): such a check prints FAIL with that reason
(on a GPU the same check FAILs on values, silently read from the freed memory).
"""
import importlib.util
import os

# (the shared part is the callables review's common.py, loaded under a name of its own; this
# folder's own helpers follow)
_spec = importlib.util.spec_from_file_location("review_common", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "callables", "common.py"))
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)
CPU, DEV, FAILS, ROOT, W = _shared.CPU, _shared.DEV, _shared.FAILS, _shared.ROOT, _shared.W
check, finish, info, same = _shared.check, _shared.finish, _shared.info, _shared.same
rng_state, skip_without_cuda = _shared.rng_state, _shared.skip_without_cuda
stats_line, sync_all, twin_run = _shared.stats_line, _shared.sync_all, _shared.twin_run

import torch  # noqa: E402


def guarded(label: str, name: str, fn) -> None:
    """``fn()`` -> (ok, detail); an exception is a FAIL with its reason (the double's "stale
    replay" AssertionError, a RuntimeError)."""
    try:
        ok, why = fn()
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"{type(e).__name__}: {str(e)[:120]}"
    check(ok, f"[{label}] {name}", why)


def pair(seed: int, width: int = None):
    """(eager Linear, its graphified twin), the same weights."""
    import copy
    import cudagraphify as cg
    from torch import nn
    torch.manual_seed(seed)
    ref = nn.Linear(width or W, width or W).to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref))


def moved_calls(g) -> int:
    import cudagraphify as cg
    return sum(n for r, n in cg.stats(g).eager_calls.items() if "resized in place" in r)
