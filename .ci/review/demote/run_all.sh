#!/usr/bin/env bash
# review: b8e0eed (a static cache whose forward changes its Python state is demoted to an opaque
# object) and c6fd56d (a region graph blocked by a later graph's held output is captured again).
# One line per check: PASS/FAIL (INFO: measurements). Under 60 s on one H200. DEV=cpu runs the
# CPU double instead (a smoke test of the scripts).
# a_findings: F1/F2 findings on the reviewed code (FAILed there; fixed since: every line should
#   PASS). b_controls: every line should PASS. c_streams: suspected stream-ordering hazards (S1
#   from c6fd56d, S2 older; both addressed since): PASS = not reproduced, FAIL = reproduced.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for s in a_findings b_controls c_streams; do
    (cd .ci/review/demote && timeout 55 python3 "$s.py") 2>/tmp/review_demote_$s.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $s exited rc=$rc: $(tail -n 1 /tmp/review_demote_$s.err)"
    fi
done
exit 0
