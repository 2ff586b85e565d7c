#!/usr/bin/env bash
# helper-97's review of the capture-failure cleanup (fix-capture2): GPU reproductions, each
# scenario in a subprocess, PASS/FAIL lines. Run from the repository root on the GPU machine.
cd "$(dirname "$0")/../../.." || exit 1
for s in r1_abandon_leak r2_stuck_side r3_share_accounting; do
  echo "== $s"
  python3 .ci/review/capture/$s.py
done
