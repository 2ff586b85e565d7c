#!/usr/bin/env bash
# Review of deb1f4d (reduce_unread) and 7448ec0 (nested tensors read from outside): one line per
# check, PASS/FAIL/INFO/SKIP. a_layout: real reduce_kernel captures; FAIL = a byte the kernel
# reads taken for unread (R1, expected on "size-1 ..." cases if a wrong offset is found there;
# may PASS where the stack garbage does not line up), INFO = candidates (R2: refusal only).
# b_share_nested: share_graph end to end (expected PASS) and nested tensors on the GPU (N1
# nested buffer: expected FAIL until fixed). Run from anywhere on a machine with one GPU
# (well under 2 minutes).
cd "$(dirname "$0")" || exit 1
for s in a_layout b_share_nested; do
  python "$s.py" || echo "FAIL $s exited with status $?"
done
