#!/usr/bin/env bash
# The GPU scripts of the reviews of the "runs that are not calls" (held tensors, objects the
# real call bound, layouts, versions): .ci/review/r60 .. r64. Each prints PASS/FAIL lines
# against eager (torch.equal); a script that exits non-zero is one FAIL line. Expected after
# the fixes: every line PASS (r63's i_resize_held_in_capture since 7f4bbe3: a module whose
# forward resizes a tensor that outlives the call runs eagerly, its submodules graphed).
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for script in .ci/review/r6[0-9]/*.py; do
    echo "== $script"
    timeout 120 python3 "$script" 2>/tmp/held_all.err
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $script exited rc=$rc: $(tail -n 1 /tmp/held_all.err)"
    fi
done
