#!/usr/bin/env bash
# hunt3 review: silent differences from eager after a graph was captured (GPU reproductions of
# the CPU findings in tests/test_review_hunt3.py, and GPU-only controls). Run from anywhere on
# the GPU machine (one GPU); about a minute. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_alias_read: an argument viewing a parameter/buffer the forward reads, written in place by
#   the forward [finding x2]; the same argument only read [control].
# b_values: mutable objects with __hash__ changed in place (attribute, argument) and values
#   equal by == ((2,)/(2.0,), 0.0/-0.0, a frozen dataclass) [finding x6]; replacements [control].
# c_static_conj: static (read in place) arguments whose conj/neg bit changes [finding x3]; a
#   copied argument [control].
# d_controls: TF32, fp32 matmul precision, cuDNN TF32, sdpa_kernel, autocast, default dtype
#   toggled between calls; a block replaced, BatchNorm put in train mode, model.half() [control].
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hunt3/$1.py" 2>"/tmp/review_hunt3_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hunt3_$1.err")"
    fi
}
run a_alias_read 40
run b_values 40
run c_static_conj 40
run d_controls 60
exit 0
