#!/usr/bin/env bash
# members review (of aad9246: a graphed submodule whose calls are all members of one graphed
# segment answered whole, its Python not run): GPU reproductions of
# tests/test_review_members.py and GPU controls. One GPU, well under a minute.
# One line per check: PASS/FAIL. [control] lines should PASS; [finding] lines FAIL where the
# finding holds.
# a_findings: F1 the skipped Python's reads outside module instance attributes (a module
#   global, a class attribute, a closure cell, a replaced function) [silent; as a piece's
#   replay: pre-existing, documented]; F2 its writes: tensors kept as attributes and a
#   write-only attribute [fixed: such a module is not answered whole, these lines PASS], a
#   global counter [silent state; as a piece's replay].
# b_controls: config object / dict / instance attribute / parameter changed, a counter, one
#   member twice with its output kept across calls, a global hook registered later.
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/members/$1.py" 2>"/tmp/review_members_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_members_$1.err")"
    fi
}
run a_findings 25
run b_controls 25
exit 0
