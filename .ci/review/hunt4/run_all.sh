#!/usr/bin/env bash
# hunt4 review: silent differences from eager in training loops (GPU reproductions of the CPU
# finding in tests/test_review_hunt4.py, and GPU controls). Run from anywhere on the GPU machine
# (one GPU); well under 90 s. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_shared_grads: two parameters whose gradients are one tensor (W + delta; pos + seg) get .grad
#   on one memory after a replay (set_to_none=True): clip_grad_norm_, GradScaler.unscale_ and
#   p.grad /= n apply twice [finding x4]; no in-place write to .grad, set_to_none=False [control].
# b_controls: optimizers (SGD momentum, Adam, AdamW foreach/fused) x zero_grad modes,
#   accumulation + clipping, reverse-order micro-batch backwards, autograd.grad / inputs=,
#   input grads and output hooks, freeze/unfreeze, BatchNorm+Dropout train/eval, tied weights,
#   a weight renormed in forward, torch.utils.checkpoint with dropout (GPU-only) [control].
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hunt4/$1.py" 2>"/tmp/review_hunt4_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hunt4_$1.err")"
    fi
}
run a_shared_grads 35
run b_controls 50
exit 0
