#!/usr/bin/env bash
# hunt review: silent differences from eager after a graph was captured. Run from anywhere on
# the GPU machine (one GPU); under 60 s. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_rng: RNG state and dropout masks against an eager twin seeded alike (inference default
#   [control], manual_seed per call [control], num_warmup_iters=3, training, segments).
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hunt/$1.py" 2>"/tmp/review_hunt_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hunt_$1.err")"
    fi
}
run a_rng 55
exit 0
