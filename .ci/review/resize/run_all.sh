#!/usr/bin/env bash
# Resize review (tests/test_review_resize.py has the CPU side): one line per check, PASS/FAIL
# (SKIP without CUDA). Run from anywhere on a machine with one GPU.
cd "$(dirname "$0")/../../.." || exit 1
for s in kept_paths addr_reuse reprobe_speed; do
  python ".ci/review/resize/$s.py" || echo "FAIL $s exited with status $?"
done
