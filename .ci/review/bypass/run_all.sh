#!/usr/bin/env bash
# Review of f9e7252 (a training graph's trial turns count the slow path) and a8abf78
# (_fast.Bypass: a piecewise root's pending pieces run plain from their DirectCall), on one GPU
# (well under 60 s). CPU side: tests/test_review_bypass.py. One line per check: PASS / FAIL /
# INFO / SKIP; [finding] lines FAIL on the code reviewed, [control] lines PASS.
# DEV=cpu: a dry run of the scripts on the CPU test double (not a GPU result).
cd "$(dirname "$0")/../../.." || exit 1
for s in piecewise hf; do
  echo "== $s"
  python ".ci/review/bypass/$s.py" || echo "FAIL $s exited with status $?"
done
exit 0
