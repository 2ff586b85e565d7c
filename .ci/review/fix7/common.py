"""Shared bits of the fix-7 review's GPU scripts (a17907e..313b2d5: registries watched and the
reason where one is referred to elsewhere, .grad refused, a graph per requires_grad pattern;
CPU reproductions in tests/test_review_fix7.py).

Every script: one line per check, ``PASS ...`` / ``FAIL ...: why`` (``INFO`` for numbers),
compared with an eager twin (torch.equal where the same kernels run), ``SKIP`` and exit 0
without CUDA. ``[finding]`` lines FAIL where the finding holds; ``[control]`` lines should PASS.
DEV=cpu: a smoke test of the scripts' own logic on the CPU double of tests/conftest.py, whose
capture is made to leave the RNG as a CUDA capture does.
"""

import importlib.util
import os

# (the same lines as hunt 7's common.py, which loads the callables review's shared part and adds
# ``scenario``: loaded under a name of its own, its names made this module's)
_spec = importlib.util.spec_from_file_location("review_hunt7_common", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "hunt7", "common.py"))
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)
globals().update({k: v for k, v in vars(_shared).items() if not k.startswith("__")})
