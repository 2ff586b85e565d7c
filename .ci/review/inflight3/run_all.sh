#!/usr/bin/env bash
# Third review of the in-flight training graphs (2653ffc: version moves measured over the
# capture's run; modules first met in a call). One line per check, PASS/FAIL/SKIP. a_controls:
# expected PASS. b_findings: T1-T4 FAIL on 2653ffc (T2 PASSes on 2661480: a regression).
# Run from anywhere on a machine with one GPU (well under 60 s). REVIEW_SIM=1: dry run on the
# CPU test double.
cd "$(dirname "$0")" || exit 1
for s in a_controls b_findings; do
  python "$s.py" || echo "FAIL $s exited with status $?"
done
