#!/usr/bin/env bash
# The threads hypothesis (see backward_during_capture.py's docstring). Run from the repository root
# on the GPU machine.
cd "$(dirname "$0")/../../.." || exit 1
echo "== backward_during_capture"
python3 .ci/review/threads2/backward_during_capture.py
