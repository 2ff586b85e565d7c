#!/usr/bin/env bash
# fix-7 review (a17907e..313b2d5): GPU reproductions of tests/test_review_fix7.py and GPU
# controls. Run from anywhere on the GPU machine (one GPU); well under a minute. One line per
# check: PASS/FAIL (INFO: numbers). [control] lines should PASS; [finding] lines FAIL where
# the finding holds.
# a_checks: S1 a family's rebased graph ignores the requires_grad pattern [finding];
#   S2 an argument's requires_grad read under no_grad [finding]; S3 a registry shared by
#   copy.copy swapped for a watched copy [finding]; L1 first call inside named_parameters()
#   eager for good [finding]; L2 explain before the first call eager for good [finding];
#   controls beside each, F5's flip, TransformerEncoder [control x7].
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py (S1 needs real retargeting:
#   there it reports its control only).
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/fix7/$1.py" 2>"/tmp/review_fix7_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_fix7_$1.err")"
    fi
}
run a_checks 50
exit 0
