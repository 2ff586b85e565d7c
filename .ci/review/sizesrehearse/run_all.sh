#!/usr/bin/env bash
# Review of fd86376..64ab868 (capture_sizes lends one size's rehearsal to the later sizes
# alike), on one GPU (well under 60 s). CPU side: tests/test_review_sizes_rehearse.py. One line
# per check: PASS / FAIL / INFO / SKIP; [finding] lines FAIL on the code reviewed, [control]
# lines PASS. DEV=cpu: a dry run on the CPU test double (not a GPU result).
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for s in hf_llama alias_write; do
  echo "== $s"
  timeout 120 python ".ci/review/sizesrehearse/$s.py" || echo "FAIL $s exited with status $?"
done
exit 0
