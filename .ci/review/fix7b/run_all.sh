#!/usr/bin/env bash
# fix-7b review (313b2d5..812c03c): GPU reproductions of tests/test_review_fix7b.py and GPU
# controls. Run from anywhere on the GPU machine (one GPU); well under a minute. One line per
# check: PASS/FAIL (INFO: numbers). [control] lines should PASS; [finding] lines FAIL where
# the finding holds.
# a_checks: SA an argument's is_leaf / is_inference() read, the static copy's taken [finding
#   x3]; LA an OrderedDict registry (a pruned ModuleList) iterated at the first call: eager
#   for good [finding x2]; LB num_warmup_iters=3 undoes the requires-grad copy [finding];
#   controls: the requires-grad copy written/returned, across grad modes, capture_sizes,
#   a graph_region chain, copy_outputs=False, plain registries in the loops, the pruned model
#   with its first call outside the loop, num_warmup_iters=1, MHA / Transformer / LSTM.
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/fix7b/$1.py" 2>"/tmp/review_fix7b_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_fix7b_$1.err")"
    fi
}
run a_checks 50
exit 0
