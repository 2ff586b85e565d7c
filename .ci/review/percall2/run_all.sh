#!/usr/bin/env bash
# percall2 review: silent differences from eager and loud regressions on branch percall (GPU
# reproductions of tests/test_review_percall2.py, and GPU controls). Run from anywhere on the
# GPU machine (one GPU); under a minute. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_values: float subclass 0.0/-0.0 (argument, attribute), range with equal elements, frozen
#   dataclass holding more than its fields (post_init list, a subclass's attribute),
#   object.__setattr__ on a frozen field, nan/-nan [finding x9]; float, replace, tuple keyword
#   on the fast path [control x3].
# b_pinned_conj: a parameter passed as an argument, then its conj/neg view [finding x2];
#   static_argnames conj (F4) [control].
# c_loud: NamedTuple, numpy scalar, frozenset arguments and numpy attributes now eager
#   [finding x7]; Size/Enum/dtype/str/tuple arguments graphed [control x5]; INFO per-call time.
# d_chain: region chains on the fast path's inline borrowed branch, kept aliases and views,
#   given-back piece, piecewise root with two threads [control x5].
# e_written: F1 variants (offset views, grad mode, region, written buffer) [control x5].
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/percall2/$1.py" 2>"/tmp/review_percall2_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_percall2_$1.err")"
    fi
}
run a_values 30
run b_pinned_conj 20
run c_loud 30
run d_chain 40
run e_written 30
exit 0
