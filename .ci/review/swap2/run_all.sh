#!/usr/bin/env bash
# Run from anywhere. One line per check: PASS / FAIL / SKIP. REVIEW_SIM=1: a CPU dry run on the
# test double (not a GPU result).
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for s in a_findings.py b_controls.py; do
  timeout 120 python ".ci/review/swap2/$s" 2>&1 | grep -E '^(PASS|FAIL|SKIP|INFO)' \
    || echo "FAIL $s did not run"
done
