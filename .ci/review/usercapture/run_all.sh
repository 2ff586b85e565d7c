#!/usr/bin/env bash
# review: edbdfad (a root's run inside a capture of the user's own runs plain and is no
# stream of its implicit region). CPU findings and controls: tests/test_review_usercapture.py.
# These scripts add what needs CUDA streams and real captures. One line per check: PASS/FAIL
# (INFO: the rest). Under 90 s on one GPU (scenarios of a and b: a process each, 10 s). Without CUDA each script prints SKIP.
# [finding] lines FAIL on the code reviewed; [control] lines PASS.
# a_same_stream: thread A captures (thread_local mode) on the stream that replayed last;
#   thread B's call meanwhile orders after it (its stream joins A's capture) [finding];
#   A on torch.cuda.graph's own stream [control]; whole graph and pieces.
# b_drain: the same, B's call releases graphs after draining A's capturing stream [finding].
# c_single: one thread, whole graph and pieces inside torch.cuda.graph [control];
#   bucketed's first call of a size inside a capture syncs [finding], checked before [control].
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() {  # script, seconds
    (cd .ci/review/usercapture && timeout "$2" python3 "$1.py") 2>/tmp/review_usercapture_$1.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc: $(tail -n 1 /tmp/review_usercapture_$1.err)"
    fi
}
run a_same_stream 45
run b_drain 22
run c_single 18
# d_elsewhere (review of 7ec8df7/dadf0ac): B's new shape captured during A's capture (a
#   device-wide sync) [finding]; a release after B's run leaves the region MULTI_STREAM
#   (drain_all) [finding]; B's calls after the capture replay again [control]
run d_elsewhere 60
exit 0
