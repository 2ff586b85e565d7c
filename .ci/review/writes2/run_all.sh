#!/usr/bin/env bash
# Run from the repository root. One line per check: PASS / FAIL / INFO.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 50 python .ci/review/writes2/bwd_hook.py 2>&1 | grep -E '^(PASS|FAIL|INFO)' || echo "FAIL bwd_hook.py did not run"
