#!/usr/bin/env bash
# hunt-8d review (of c672b9e + f8c82f7: tensors passed twice are another key, checked by the
# fast path; the probe's Python-attribute patches, Tensor.__getattr__ / __getattribute__):
# GPU reproductions of tests/test_review_hunt8d.py and GPU controls. Run from anywhere on the
# GPU machine (one GPU); well under a minute. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_checks: S1 a repeated key captured on distinct copies, S2 x.__dict__ / vars(x) of an
#   unattributed argument, S3 an attribute of an argument read in place (static_argnames,
#   mark_static, a parameter), S4 an attribute carried by copy.deepcopy, S5 an own parameter's
#   attribute (pre-existing) [finding: silent]; L1 EagerFast of a repeated call takes distinct
#   calls (x is y, nn.MultiheadAttention self-attention), L2 a missing attribute on a view /
#   detach of an argument refused, E1 explain misses the attribute / pinned refusals
#   [finding: loud]; controls: the repeated key (positional, keyword, HF-style mixed, list,
#   6 tensors; graph_region, share_graph, capture_sizes), attribute refusals, patches gone
#   after an exception, __cuda_array_interface__ refused / hasattr of it graphed.
# b_models: LSTM, TransformerEncoderLayer (train), checkpoint, parametrize, HF GPT-2 / Llama
#   (labels=input_ids too), timm ResNet / ViT: the same plan without the attribute patches
#   [control].
# c_timing: Fast's distinctness check, ns per call for 1, 2, 3, 6 tensors [INFO].
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hunt8d/$1.py" 2>"/tmp/review_hunt8d_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hunt8d_$1.err")"
    fi
}
run a_checks 14
run b_models 22
run c_timing 8
exit 0
