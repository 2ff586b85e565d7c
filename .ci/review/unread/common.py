"""Shared set-up of the review of _unread.py (nocast lambdas, cat metadata, casting loaders and
storers) on a GPU. One line per check: PASS/FAIL/INFO/SKIP. tests/test_review_unread.py has the
CPU side (U1)."""
import os
import sys
import warnings

import torch

if not torch.cuda.is_available():
    print(f"SKIP {os.path.basename(sys.argv[0])}: needs a CUDA GPU")
    sys.exit(0)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
import cudagraphify as cg  # noqa: E402,F401

warnings.simplefilter("ignore")
DEV = torch.device("cuda")


def report(ok, what, detail=""):
    print(f"PASS {what}" if ok else f"FAIL {what}: {detail}", flush=True)


def info(what):
    print(f"INFO {what}", flush=True)


def check(what, fn):
    """Run ``fn`` (returns None or a failure detail); an exception is a FAIL."""
    try:
        detail = fn()
    except Exception as e:  # noqa: BLE001
        detail = f"{type(e).__name__}: {str(e)[:300]}"
    report(detail is None, what, detail or "")
