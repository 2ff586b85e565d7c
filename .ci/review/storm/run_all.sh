#!/usr/bin/env bash
# review19: state_key's CUDA-only address check and memo cost (see tests/test_review_storm.py
# for the CPU findings, fixed). One line per check: PASS/FAIL (INFO: measurements). Under 60 s.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 55 python3 .ci/review/storm/a_state_key.py 2>/tmp/review19_a.err
rc=$?
[ $rc -ne 0 ] && echo "FAIL a_state_key exited rc=$rc: $(tail -n 1 /tmp/review19_a.err)"
exit 0
