#!/usr/bin/env bash
# callables review of d3132f3 (callables kept as module attributes watched; a forward's own
# reads of its module's __dict__ recorded): GPU reproductions of tests/test_review_callables.py
# and GPU controls. Run from anywhere on the GPU machine (one GPU); under a minute. One line per
# check: PASS/FAIL (INFO: numbers). [control] lines should PASS; [finding] lines FAIL where the
# finding holds.
# a_silent: a function's defaults (lambda default binding, mutable default, __kwdefaults__)
#   [finding x3, S1]; a bound method's function closure [finding, S2]; __dict__ read through
#   object.__getattribute__ / __getstate__ [finding x2, S3]; closures, vars/getattr/helper
#   [control x5].
# b_loud: WeakMethod attribute [L1], deep/wide partials and bound methods [L2 x4], unread tensor
#   of a bound method's object replaced every step [L3], vars(self) + attribute set every call
#   [L4], numpy array in a closure [L5] (a [finding] FAILs where not graphed once); the same
#   dict as self.cfg, self.scale + m.step, weakref.ref [control x3].
# c_cost: INFO graphed and eager microseconds per call for modules calling a torch function,
#   a partial, a lambda over a dict, a bound method, vars(self), and the per-call checks of
#   each callable timed alone (run it from a checkout of
#   d3132f3^ too to compare); [control] all graphed once.
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/callables/$1.py" 2>"/tmp/review_callables_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_callables_$1.err")"
    fi
}
run a_silent 30
run b_loud 30
run c_cost 40
exit 0
