#!/usr/bin/env bash
# Review of d043b8d, training graphs in the pieces' trial (tests/test_review_trial_training.py
# has the CPU side): one line per check, PASS/FAIL (SKIP without CUDA). T1 FAILed on d043b8d
# (fixed since: PASS expected). Run from anywhere on a machine with one GPU.
cd "$(dirname "$0")/../../.." || exit 1
for s in trial_train; do
  python ".ci/review/trialtrain/$s.py" || echo "FAIL $s exited with status $?"
done
