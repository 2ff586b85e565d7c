#!/usr/bin/env bash
# review: 1d05912 (StateGuard holds its callable's own module tree weakly: a shared policy's or
# an open region's cache must free a deleted module) and 1ebb457 (a region graph blocked by a
# later graph's held output is captured again after 3 blocked calls with at most one use
# between). CPU findings and controls: tests/test_review_weak.py. These scripts measure on a GPU
# what the CPU double cannot (memory actually freed, streams).
# One line per check: PASS/FAIL (INFO: measurements). Under 90 s on one H200. DEV (default
# cuda) picks the device; DEV=cpu runs the CPU double (tests/conftest.py), a smoke test.
# [finding] lines FAIL on the code reviewed; [control] lines PASS; [suspicion]: FAIL =
# reproduced.
# a_leaks: the bytes a deleted module leaves behind in a shared policy's cache and an open
#   region (a value read that points back at the module, a submodule's own forward, tensors an
#   entry keeps), and whether the next module of a shared policy gets its own outputs;
# b_blocked: a callable called 2, 3, 4 times per step with one signature, blocked once a step
#   by a later graph's held output (recaptures, blocked calls, time per step), and HF T5 greedy
#   generate with a static cache (decoder.dropout), where transformers is installed;
# c_streams: the twice-per-step pattern from two threads, each on its own CUDA stream (its own
#   region, then one piecewise root whose implicit region both share), every value bitwise
#   eager's;
# d_orphan: a shared policy's orphaned entry (its module deleted: 1d05912 makes that common)
#   dropped by the next lookup while another module's replay of it is still queued on its own
#   stream (no drain): is memory allocated afterwards overwritten? [suspicion]
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DEV="${DEV:-cuda}"
run() {  # script, seconds
    (cd .ci/review/weak && timeout "$2" python3 "$1.py") 2>/tmp/review_weak_$1.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc: $(tail -n 1 /tmp/review_weak_$1.err)"
    fi
}
run a_leaks 30
run b_blocked 40
run c_streams 20
run d_orphan 20
exit 0
