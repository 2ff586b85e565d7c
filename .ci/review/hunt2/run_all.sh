#!/usr/bin/env bash
# hunt2 review: silent differences from eager after a graph was captured (GPU-only parts; CPU
# reproductions and controls in tests/test_review_hunt2.py). Run from anywhere on the GPU
# machine (one GPU); under 60 s. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_streams: graphed calls under torch.cuda.stream(s) after capture on the default stream,
#   results used on s without a host sync [control].
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hunt2/$1.py" 2>"/tmp/review_hunt2_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hunt2_$1.err")"
    fi
}
run a_streams 55
exit 0
