#!/usr/bin/env bash
# review18: 3abfc0c (.data aliases), a432bc4 (retired pieces). One line per check: PASS/FAIL.
# Found on 3abfc0c/a432bc4 (D1-D3, P1, R7, R8), fixed in 25333bf/c9bf8b1: every line should PASS.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for s in a_data_alias b_retire_guard; do
    (cd .ci/review/aliases && timeout 50 python3 "$s.py") 2>/tmp/review18_$s.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $s exited rc=$rc: $(tail -n 1 /tmp/review18_$s.err)"
    fi
done
