#!/usr/bin/env bash
# hunt 7 (module-level transformations and indirect reads changed after capture): GPU
# reproductions of tests/test_review_hunt7.py and GPU controls. Run from anywhere on the GPU
# machine (one GPU); under a minute. One line per check: PASS/FAIL (INFO: numbers). [control]
# lines should PASS; [finding] lines FAIL where the finding holds.
# a_silent: F1 ModuleList/Sequential changed after a del [finding x4]; F2 OrderedDict
#   registries [finding x2]; F3 .grad read in forward, set_to_none [finding]; F4 a
#   parameter's Python attribute [finding]; F5 requires_grad under no_grad [finding]; F6
#   __slots__ / own-store descriptor [finding x2]; F7 MappingProxyType / dict.values()
#   [finding x2]; controls beside F1, F2, F3 [control x3].
# b_controls: parametrize, spectral_norm train/eval, LoRA-style toggles, norm flags
#   [control x11].
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hunt7/$1.py" 2>"/tmp/review_hunt7_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hunt7_$1.err")"
    fi
}
run a_silent 40
run b_controls 30
exit 0
