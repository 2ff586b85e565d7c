#!/usr/bin/env bash
# review17: HF transformers caches passed to graphify(model). One line per check: PASS/FAIL.
# a_keyfn: findings on the reviewed code, fixed in the commit after it; b_controls: controls. Every line should PASS.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for s in a_keyfn b_controls; do
    timeout 55 python3 ".ci/review/hfcache/$s.py" 2>/tmp/review17_$s.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $s exited rc=$rc: $(tail -n 1 /tmp/review17_$s.err)"
    fi
done
