#!/usr/bin/env bash
# zoo: graphify(model) on HF architectures (tiny configs) against eager twins: inference at two
# lengths, generate() with the default cache, training steps. One GPU, about two minutes.
# [zoo] lines should PASS. DEV=cpu (with ZOO=gpt2,bert): a smoke test on the CPU double.
cd "$(dirname "$0")/../../.." || exit 1
timeout "${ZOO_SECONDS:-240}" python3 .ci/review/zoo/a_hf.py 2>/tmp/review_zoo.err
rc=$?
[ $rc -ne 0 ] && echo "FAIL zoo exited rc=$rc (124: timed out): $(tail -n 1 /tmp/review_zoo.err)"
exit 0
