#!/usr/bin/env bash
# Second review of the in-flight training graphs (d62294e, fixes 31e55a3 and 2661480: version
# counters moved by training replays). One line per check, PASS/FAIL/SKIP. a_controls: expected
# PASS. b_findings: R1-R5 FAIL on 2661480 (R1 PASSes on 380d851: a regression of 2661480).
# Run from anywhere on a machine with one GPU (well under 40 s). REVIEW_SIM=1: dry run on the
# CPU test double.
cd "$(dirname "$0")" || exit 1
for s in a_controls b_findings; do
  python "$s.py" || echo "FAIL $s exited with status $?"
done
