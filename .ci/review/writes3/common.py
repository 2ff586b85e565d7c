"""Shared set-up of the writes3 review scripts (fix-writes3: the capture's backward under a write
tracker, Capturing._watch_backward; the layouts of the tensors from before the call put back,
_writes.put_seen_back). One line per check: PASS/FAIL/SKIP, tagged [finding ...] or [control].
``REVIEW_SIM=1``: a dry run on the CPU test double (tests/conftest.py); not a GPU result (G8
differs there by design, and G6 did before fix-hooks: see tests/test_review_writes3.py)."""

import importlib.util
import os

# (the set-up is the hooks review's common.py, the same lines: loaded under a name of its own,
# its names made this module's)
_spec = importlib.util.spec_from_file_location("review_hooks_common", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "hooks", "common.py"))
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)
globals().update({k: v for k, v in vars(_shared).items() if not k.startswith("__")})
