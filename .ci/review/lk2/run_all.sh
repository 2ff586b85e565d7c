#!/usr/bin/env bash
# lk2 review (of 726d373..1139dfc: leaf kind in the key; Fast/EagerFast keep the attributed
# pattern; a copied nn.Parameter's static copy is a Parameter on the same memory): GPU
# reproductions of tests/test_review_lk2.py and GPU controls. One GPU, well under a minute.
# One line per check: PASS/FAIL. [control] lines should PASS; [finding] lines FAIL where the
# finding holds.
# a_findings: F1 a region's borrowed slot is captured plain for a Parameter-wrapped alias
#   [silent]; F2 a forward binding its Parameter argument registers the graph's static copy
#   [silent state] and captures graphs never replayed [cost]; P1 the same for
#   nn.Parameter(x) of a plain argument [silent, pre-existing]; P2 an output's class /
#   attributes lost on replay [silent, pre-existing].
# b_controls: training and no_grad graphs of Parameter arguments; Fast with alternating kinds.
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/lk2/$1.py" 2>"/tmp/review_lk2_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_lk2_$1.err")"
    fi
}
run a_findings 60
run b_controls 60
exit 0
