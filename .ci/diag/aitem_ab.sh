#!/usr/bin/env bash
# A/B of the A-item row's host time (.ci/diag/aitem_cpu.py) on one machine: this tree's library
# against an exported older one (LIB, default .device/lib-old: `git archive <rev> cudagraphify |
# tar -x -C .device/lib-old`), alternating, ROUNDS times each (default 2). Prints, per run, the
# µs per forward (eager, graphify, ratio) and each piece's call split (dispatch, checks and
# hand-out, copy-in, replay).
cd "$(dirname "$0")/../.." || exit 1
lib=${LIB:-.device/lib-old}
for r in $(seq "${ROUNDS:-2}"); do
  for which in new old; do
    if [ "$which" = old ]; then pp="$PWD/$lib:${PYTHONPATH:-}"; else pp="$PWD:${PYTHONPATH:-}"; fi
    echo "-- $which (round $r)"
    PYTHONPATH="$pp" python3 .ci/diag/aitem_cpu.py "$@" 2>&1 \
      | grep -E "^  (eager|graphify) |^  (ln1|attn|ln2|mlp) |own ops|instrumented|root:"
  done
done
