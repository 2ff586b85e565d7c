#!/usr/bin/env bash
# Review of fix-versions (cudagraphify/_versions.py): [finding] lines FAIL on the reviewed code,
# [control] lines PASS. One GPU, well under a minute. REVIEW_SIM=1: dry run on the CPU double.
cd "$(dirname "$0")" || exit 1
python checks.py || echo "FAIL checks exited with status $?"
