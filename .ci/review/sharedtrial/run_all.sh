#!/usr/bin/env bash
# Review of "a second training graph shares its busy twin's trial": one line per check,
# PASS/FAIL/INFO/SKIP. The T1/T2 checks FAIL on the change (PASS before it); controls PASS.
# Well under 45 s on one H100; SKIPs without CUDA. REVIEW_SIM=1: dry run on the CPU double.
cd "$(dirname "$0")" || exit 1
python checks.py || echo "FAIL checks.py exited with status $?"
