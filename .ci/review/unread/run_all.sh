#!/usr/bin/env bash
# Review of _unread.py (unread bytes of nocast lambdas, cat metadata, casting loaders/storers):
# one line per check, PASS/FAIL/INFO/SKIP.
# a_poison: real launches of each family captured twice; every byte unread_bytes declares unread
#   is overwritten (0xFF, then random) in an instantiated copy of the graph, which must still
#   give eager's values bitwise (FAIL = a byte the kernel reads was declared unread; a crash of
#   the script = the same, through an address or a size it read). INFO: which launches were
#   recognised, and bytes that differ between two captures but are not unread (refusal only).
# b_share_e2e: share_graph over two layers that differ only in something these kernels read
#   (hidden from the attribute guards: a dict keyed by id(layer)), first calls on zeros (which
#   hide the difference from the first-call bitwise check), later calls random: every output
#   must equal eager bitwise (expected PASS: refused or equal). U1 (tests/test_review_unread.py)
#   needs a functor of 112+ bytes that stock PyTorch kernels do not have: CPU only.
# Run from anywhere on a machine with one GPU (well under 2 minutes).
cd "$(dirname "$0")" || exit 1
for s in a_poison b_share_e2e; do
  python "$s.py" || echo "FAIL $s exited with status $?"
done
