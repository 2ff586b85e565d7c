#!/usr/bin/env bash
# hf review: the random stream after graphed calls against eager's. Run from anywhere on the
# GPU machine (one GPU); under 60 s. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_share_rng: share_graph's RNG probe replay (a refused template) moves the CUDA generator.
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hf/$1.py" 2>"/tmp/review_hf_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hf_$1.err")"
    fi
}
run a_share_rng 55
exit 0
