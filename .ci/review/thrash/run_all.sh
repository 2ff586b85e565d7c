#!/usr/bin/env bash
# review: d21c591 (a signature whose graph was evicted twice runs eagerly for good) and 99043f9
# (a callable that demoted two static caches of one kind demotes the next one at once).
# One line per check: PASS/FAIL (INFO: measurements). Under 60 s on one H200. DEV (default
# cuda) picks the device; DEV=cpu runs the CPU double (tests/conftest.py), a smoke test.
# Lines marked [finding] FAILed on the code reviewed (all about speed, no wrong value) and PASS
# since the fixes, but one: "a shared policy's next module" FAILs because the deleted module is
# kept alive (its graphs' guards hold Read objects with the module; a pre-existing leak of
# shared caches, not fixed), so its graphs fill the shared cache. [control] lines PASS;
# [suspicion] lines: FAIL = reproduced (GPU only).
# a_thrash: the thrash rule; b_kind_prefill: HF Qwen2 sliding-window generate() with a new
# prompt length per request (time-bounded loops); c_reuse: thrash marks at reused cache
# addresses (generate() outputs kept in rounds).
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DEV="${DEV:-cuda}"
run() {  # script, seconds
    (cd .ci/review/thrash && timeout "$2" python3 "$1.py") 2>/tmp/review_thrash_$1.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc: $(tail -n 1 /tmp/review_thrash_$1.err)"
    fi
}
run a_thrash 15
run b_kind_prefill 30
run c_reuse 13
exit 0
