#!/usr/bin/env bash
# review16: commit 9b19651 (given-back pieces retired). One line per check: PASS/FAIL.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for s in a_basic_controls b_outer_guard c_races d_api; do
    timeout 50 python3 ".ci/review/retire/$s.py" 2>/tmp/review16_$s.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $s exited rc=$rc: $(tail -n 1 /tmp/review16_$s.err)"
    fi
done
