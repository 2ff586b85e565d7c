#!/usr/bin/env bash
# leaf-kind review (of 726d373: a tensor leaf's class and whether it carries Python attributes
# are in the key, _signature.leaf_kind; Fast refuses / misses attributed calls): GPU
# reproductions of tests/test_review_lk.py and GPU controls. Run from anywhere on the GPU
# machine (one GPU); well under a minute. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_checks: S1 a Parameter key captured on a plain copy (isinstance / type() scalar branch;
#   a training graph's outputs and grads), S2 attribute reads the probe does not see
#   (inspect.getattr_static, torch's _is_param check), S3 bucketed keys its check without the
#   leaf's kind [finding: silent]; L1 an attributed call's EagerFast takes plain calls
#   [finding: loud]; controls: the same tensor tagged later, a Parameter key's Fast, attributed
#   / Parameter arguments after plain ones under graph_region, share_graph, capture_sizes, by
#   keyword, HF-style mixed keywords.
# b_timing: C1 nn.Buffer / mark_dynamic / mark_static_address arguments never get Fast
#   [finding: cost], us per call beside a plain argument [INFO].
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/lk/$1.py" 2>"/tmp/review_lk_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_lk_$1.err")"
    fi
}
run a_checks 60
run b_timing 60
exit 0
