#!/usr/bin/env bash
# Version counters moved by replays and checked at backward (cudagraphify/_versions.py): a
# parameter or buffer rebound to another tensor object on the same memory, tensors sharing one
# counter, inference replays (the fast path too). One line per check, PASS/FAIL/SKIP; all
# expected PASS. Run from anywhere on a machine with one GPU (well under a minute).
# REVIEW_SIM=1: dry run on the CPU test double.
cd "$(dirname "$0")" || exit 1
python checks.py || echo "FAIL checks exited with status $?"
