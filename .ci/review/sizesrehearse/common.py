"""Shared bits of the review of fd86376..64ab868 (capture_sizes lends one size's rehearsal to
the later sizes alike; each capture confirms it). CPU findings and controls:
tests/test_review_sizes_rehearse.py.

DEV (env, default "cuda"): DEV=cpu (or no CUDA device) runs the CPU double of tests/conftest.py
(the simulated capture backend, answering is_current_stream_capturing as a capture does): a
smoke test of the scripts, not a GPU result. One line per check: PASS / FAIL / INFO / SKIP;
[finding] lines FAIL on the code reviewed, [control] lines PASS. Every script exits 0."""
import contextlib
import os
import sys
import warnings

import torch

import cudagraphify as cg
from cudagraphify import _capture, _first_call

warnings.simplefilter("ignore")

DEV = os.environ.get("DEV", "cuda")
if DEV.startswith("cuda") and not torch.cuda.is_available():
    print("INFO no CUDA device: DEV=cpu (the CPU double; not a GPU result)", flush=True)
    DEV = "cpu"
CPU = DEV == "cpu"
_HERE = os.path.dirname(os.path.abspath(__file__))
if CPU:
    sys.path.insert(0, os.path.join(_HERE, "..", "..", "..", "tests"))
    from conftest import SimBackend
    _SIM = SimBackend()
    _capture.set_backend(_SIM)
    torch.cuda.is_current_stream_capturing = lambda: _SIM.capturing
    torch.set_num_threads(1)
_capture.CudaBackend.clock = None  # (no piece trial: decisions not by the machine's speed)


def check(ok, what, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)
    return ok


def info(what):
    print(f"INFO {what}", flush=True)


def skip(what, why):
    print(f"SKIP {what}: {why}", flush=True)


@contextlib.contextmanager
def lending(on: bool):
    """Lending as reviewed (on), or as before fd86376 (off: borrow lends nothing); yields the
    list of rehearsals run (one entry each)."""
    n = []
    real_rehearse, real_borrow = _first_call.rehearse, _first_call.borrow
    _first_call.rehearse = lambda first: n.append(1) or real_rehearse(first)
    if not on:
        _first_call.borrow = lambda first: None
    try:
        yield n
    finally:
        _first_call.rehearse, _first_call.borrow = real_rehearse, real_borrow


def trusting(*modules):
    policy = cg.OpPolicy()
    policy.TRUSTED_CAPTURED_PATHS = tuple(modules) + tuple(policy.TRUSTED_CAPTURED_PATHS)
    return policy
