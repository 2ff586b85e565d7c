#!/usr/bin/env bash
# waits review (of 3741ed7: _segmodes.waits places the waits the record's profile shows between
# calls, and a segment replays after them): GPU reproductions of tests/test_review_waits.py W1
# and W2, with controls. One GPU, well under 40 s. One line per check: PASS/FAIL. [finding]
# lines FAIL where the finding holds; [control] lines should PASS. SKIP without CUDA.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/waits/$1.py" 2>"/tmp/review_waits_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_waits_$1.err")"
    fi
}
run a_findings 40
exit 0
