#!/usr/bin/env bash
# review of 6c0e2ee/32c964b (one side stream per device AND thread). Run from anywhere on the GPU
# machine; under 90 s on one H100/H200 (each script 2-10 s, CUDA init included; the timeouts
# sum to 90 s). One line per check: PASS/FAIL (INFO: numbers). [finding] lines FAIL on the code
# reviewed; [control] lines PASS; [cost]: FAIL = the cost shown. DEV=cpu: a smoke test of the
# scripts on the CPU double of tests/conftest.py (no streams: every line passes there).
# a_backward_other_thread: a first call's forward on an executor worker, its backward on the
#   caller while the worker captures on its side stream [finding x2]; after it [control].
# b_pool_collision: a short-lived thread whose pool stream is the main thread's side stream
#   captures while the main thread runs its first call's backward [finding]; another [control].
# c_accumulate_grad_stream: parameters' AccumulateGrad nodes made by thread B's first call (on
#   B's side stream): the main thread's backward through them while B captures [finding];
#   nodes made on the main thread first [control].
# d_cached_per_thread: warm-up blocks cached per thread's side stream [cost].
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/threads3/$1.py" 2>"/tmp/review_threads3_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_threads3_$1.err")"
    fi
}
run a_backward_other_thread 25
run b_pool_collision 25
run c_accumulate_grad_stream 20
run d_cached_per_thread 20
exit 0
