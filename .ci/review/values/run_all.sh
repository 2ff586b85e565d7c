#!/usr/bin/env bash
# values review: how non-tensor values are keyed (numpy scalars, Decimal, datetime, frozen
# dataclasses, host scalars) and shared gradient buffers in training (GPU reproductions of the
# CPU findings in tests/test_review_values.py, and controls). Run from anywhere on the GPU
# machine (one GPU); under a minute. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_numpy_keys: timedelta64 units, np.void dtypes / objects / array rows [finding x5];
#   np.float32 -0.0, np.float64 keyword, np.void argument rewritten [control].
# b_stdlib_keys: Decimal('-0') after Decimal('0') (positional, keyword, tuple), aware datetime
#   of one instant, frozen eq=False dataclass instances, a NamedTuple subclass's
#   attribute [finding x6]; float/complex zero signs, other Decimals [control].
# c_loud: neg-bit host tensor attribute raises, plain frozen-dataclass subclass eager,
#   np.longdouble padding recaptures [finding x3]; host scalar sign, frozen dataclass [control].
# d_training: parameters sharing one gradient buffer, clip / accumulate / set_to_none=False
#   [control x7].
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/values/$1.py" 2>"/tmp/review_values_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_values_$1.err")"
    fi
}
run a_numpy_keys 40
run b_stdlib_keys 40
run c_loud 40
run d_training 60
exit 0
