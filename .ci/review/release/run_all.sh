#!/usr/bin/env bash
# review: 2a3e79c (Slot.thread; release_aliases at the end of a root's run; capture_sizes from
# _engine.sizes_log) and cd1f035 (GraphRegion.enter_run/exit_run/order_before_replay,
# MULTI_STREAM). CPU findings and controls: tests/test_review_release.py. These scripts add what
# needs CUDA streams. One line per check: PASS/FAIL (INFO: measurements). Under 2 min on one
# H200. DEV (default cuda) picks the device; DEV=cpu runs the CPU double (tests/conftest.py), a
# smoke test (no streams there: the stream checks pass by construction).
# [finding] lines FAIL on the code reviewed; [control] lines PASS.
# a_enter_unordered: B replayed last, A starts a run, B starts one: enter_run sets no
#   MULTI_STREAM (the last stream is B's own); B's later replay of a is not ordered after A's
#   stream, where A's queued op still reads a's dropped output [finding]; the same where the
#   main thread replayed last [control];
# b_side_stream: one thread, a forward that replays its pieces on a side stream of its own:
#   the region stays MULTI_STREAM for good, every piece replay slow and ordered [finding];
#   values [control];
# c_chain_cost: the per-run cost _chain_run gained [control], INFO per part.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DEV="${DEV:-cuda}"
run() {  # script, seconds
    (cd .ci/review/release && timeout "$2" python3 "$1.py") 2>/tmp/review_release_$1.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc: $(tail -n 1 /tmp/review_release_$1.err)"
    fi
}
run a_enter_unordered 60
run b_side_stream 120
run c_chain_cost 60
exit 0
