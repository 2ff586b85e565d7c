#!/usr/bin/env bash
# launch review (of 9da4dcf: a segment's graph replays at its last call that copies an input,
# _Segment.launch, and _Run.entered keeps the segment matched after that): GPU reproductions of
# tests/test_review_launch.py and GPU controls. One GPU, well under a minute. One line per
# check: PASS/FAIL. [finding] lines FAIL where the finding holds (F1, F2); [control] lines
# should PASS. F1 is fixed (the guard check runs with no mode; a segment replayed before its
# launch replays again at it) and F2 on CUDA (the record's profile shows the wait: the segment
# replays after it): every line should PASS on a GPU. DEV=cpu: a smoke test on the CPU double
# (F2 emulated there by a write no mode sees: it FAILs there, as no profiler runs on the CPU).
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/launch/$1.py" 2>"/tmp/review_launch_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_launch_$1.err")"
    fi
}
run a_findings 40
run b_controls 40
exit 0
