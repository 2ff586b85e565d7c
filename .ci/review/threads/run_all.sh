#!/usr/bin/env bash
# review: 8b11f19 (a piece neither moves nor overwrites an output alias while another thread
# runs the root of its implicit region; that call runs eagerly, HELD_BY_ANOTHER_THREAD) and
# 4a11b5c (capture_sizes' first sight in a contextvar). CPU findings and controls:
# tests/test_review_threads.py. These scripts add what needs CUDA streams (one per thread).
# One line per check: PASS/FAIL (INFO: measurements). Under 2 min on one H200. DEV (default
# cuda) picks the device; DEV=cpu runs the CPU double (tests/conftest.py), a smoke test (no
# streams there: a_dropped_alias passes by construction).
# [finding] lines FAIL on the code reviewed; [control] lines PASS; [suspicion]: FAIL = reproduced.
# a_dropped_alias: A drops a's output with an op reading it still queued on its stream; B's
#   replay on its own stream (it replayed last: no order_after) overwrites it first [finding];
#   the same on one shared stream [control];
# b_serving: 2 and 4 threads serving one piecewise model, each on its own stream: share of
#   the pieces' calls run eagerly (HELD_BY_ANOTHER_THREAD) [finding], values [suspicion];
# c_held_alias: an alias held by a thread NOT running the root (kept in its cache, returned in
#   an object pytree does not flatten, an explicit region reached through a copied context),
#   read while another thread calls: moved and overwritten under the read [finding on the
#   CPU double; on a GPU order_after may hide it], read inside the root [control].
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DEV="${DEV:-cuda}"
run() {  # script, seconds
    (cd .ci/review/threads && timeout "$2" python3 "$1.py") 2>/tmp/review_threads_$1.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc: $(tail -n 1 /tmp/review_threads_$1.err)"
    fi
}
run a_dropped_alias 40
run b_serving 120
run c_held_alias 90
exit 0
