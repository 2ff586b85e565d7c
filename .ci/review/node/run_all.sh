#!/usr/bin/env bash
# review of 9dddd85/99d7faa (a first call's real call on the caller's stream; side streams
# primed for cuBLAS/cuBLASLt). bd9c6ad (Tensor.grad_fn shadowed) is CPU-tested in
# tests/test_review_node.py. Run from anywhere on the GPU machine; under 60 s on one H100/H200
# (timeouts sum to 58 s). One line per check: PASS/FAIL (INFO: numbers, SKIP: not applicable).
# [control] lines should PASS; [finding?] FAILs where the suspected regression holds.
# DEV=cpu: a smoke test of a/b on the CPU double of tests/conftest.py (c says SKIP there).
# a_training_streams: training first calls on the default/a user stream, extra warm-ups or
#   not, input requiring grad or not: bitwise outputs, close gradients, graphed [control].
# b_inference_region: inference on a user stream, a graph_region chain A->B whose first
#   calls feed each other, an input written on the caller's stream right before [control].
# c_cublas_priming: no cuBLAS workspace made inside an inference capture, per op/dtype
#   [control]; after torch._C._cuda_clearCublasWorkspaces() [finding?]; a raw baseline.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/node/$1.py" 2>"/tmp/review_node_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_node_$1.err")"
    fi
}
run a_training_streams 20
run b_inference_region 18
run c_cublas_priming 20
exit 0
