#!/usr/bin/env bash
# grow review of c213750 (a region slot's memory checked as a copy_outputs=False output's; an
# alias grown in place makes its graph run eagerly for good): GPU reproductions of
# tests/test_review_grow.py and GPU controls. Run from anywhere on the GPU machine (one GPU);
# under a minute. One line per check: PASS/FAIL (INFO: numbers). [control] lines should PASS;
# [finding] lines FAIL where the finding holds.
# a_silent: a graph borrowing a slot whose memory moved reads the old memory: fa's alias grown
#   and dropped then fb(fa(x)), the moved alias passed straight to fb (4 ways), a piecewise root
#   growing a piece's output on one call [finding x6, G1]; a shrink-only alias borrowed, the
#   chain with no growth, the moved slot's own graph for 6 ways of moving, .data=/.grad=, an
#   earlier graph past a kept grown alias, the region reopened [control x13].
# b_loud: a released graph's stale _slots key keeps the caller's grown storage [finding, G2];
#   swap_tensors on a piece's output / a region alias raises [finding x2, G3]; released graph
#   without a growth, argument object with .static, training graph, two threads [control x4].
# c_cost: INFO microseconds per call (region graph, chain, outside, eager); [control] the
#   region's fast path takes every call with its slot in entry.handed.
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/grow/$1.py" 2>"/tmp/review_grow_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_grow_$1.err")"
    fi
}
run a_silent 30
run b_loud 20
run c_cost 10
exit 0
