"""Shared bits of the fix-7b review's GPU scripts (313b2d5..812c03c: a registry kept elsewhere
left unwatched, iterations and generators passing; explain watching first; a rebased family's
requires_grad pattern; under no_grad a requires-grad argument's static copy requiring grad;
CPU reproductions in tests/test_review_fix7b.py).

Every script: one line per check, ``PASS ...`` / ``FAIL ...: why`` (``INFO`` for numbers),
compared with an eager twin (torch.equal where the same kernels run), ``SKIP`` and exit 0
without CUDA. ``[finding]`` lines FAIL where the finding holds; ``[control]`` lines should PASS.
DEV=cpu: a smoke test of the scripts' own logic on the CPU double of tests/conftest.py, whose
capture is made to leave the RNG as a CUDA capture does.
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


def scenario(make, change, before=3, after=3, fresh=False, train=False, shape=(8, 64)):
    """(ok, detail, graphed): ``make()`` graphed beside an eager twin (a deep copy, or built
    again from the same seed with ``fresh``); ``before`` no_grad calls, ``change`` on both,
    ``after`` more. Not ok also where nothing replayed before the change (proves nothing)."""
    import copy
    import cudagraphify as cg
    torch.manual_seed(0)
    ref = make().to(DEV).train(train)
    if fresh:
        torch.manual_seed(0)
        g = make().to(DEV).train(train)
    else:
        g = copy.deepcopy(ref)
    g = cg.graphify(g)
    with torch.no_grad():
        for i in range(before + after):
            if i == before:
                if cg.stats(g).replays < 1:
                    return False, "no replay before the change: " + stats_line(g), g
                change(ref)
                change(g)
            x = torch.randn(*shape, device=DEV)
            got, want = g(x.clone()), ref(x.clone())
            sync_all()
            ok, why = same(got, want)
            if not ok:
                return False, f"call {i}: {why} ({stats_line(g)})", g
    return True, "", g
