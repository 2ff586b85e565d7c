#!/usr/bin/env bash
# Review of d62294e (a second training graph of a signature while the first waits for its
# backward): one line per check, PASS/FAIL/SKIP. a_controls: expected PASS. b_findings: F1, F2,
# F4, F5 FAIL on d62294e (F4b is pre-existing: FAILs on 380d851 too). Run from anywhere on a
# machine with one GPU (well under 60 s). REVIEW_SIM=1: dry run on the CPU test double.
cd "$(dirname "$0")" || exit 1
for s in a_controls b_findings; do
  python "$s.py" || echo "FAIL $s exited with status $?"
done
