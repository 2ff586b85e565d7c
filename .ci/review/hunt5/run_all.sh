#!/usr/bin/env bash
# hunt5 review: silent differences from eager around a model's lifecycle and hooks (GPU
# reproductions of the CPU findings in tests/test_review_hunt5.py, and GPU controls). Run from
# anywhere on the GPU machine (one GPU); under a minute. One line per check: PASS/FAIL (INFO:
# numbers). [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_callable_attrs: a callable kept as a module attribute (bound method of a plain object, a
#   lambda over a dict or a rebound local, functools.partial, a function attribute) whose
#   non-tensor reads change after capture, and a weakref/proxy to a plain object [finding x7];
#   a callable object, the object kept as the attribute, a tensor read (refused) [control x3].
# b_dict_reads: a forward reading self.__dict__.get / vars(self), then m.scale = ... [finding x2];
#   getattr [control].
# c_controls: ungraphify/graphify again, load_state_dict (copy, assign), .cpu()/.cuda() round
#   trip, half/float, a parameter replaced, nested graphify, hooks (grandchild, global, full
#   backward) added after capture, sizes beyond max_graphs with weight updates [control];
#   INFO: ungraphify between forward and backward (loud).
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hunt5/$1.py" 2>"/tmp/review_hunt5_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hunt5_$1.err")"
    fi
}
run a_callable_attrs 40
run b_dict_reads 30
run c_controls 60
exit 0
