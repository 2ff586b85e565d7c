#!/usr/bin/env bash
# hunt-8c review (of 3ca76f2: the probe refuses reads of what a copied argument's static copy
# does not keep): GPU reproductions of tests/test_review_hunt8c.py and GPU controls. Run from
# anywhere on the GPU machine (one GPU); well under a minute. One line per check: PASS/FAIL
# (INFO: numbers). [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_checks: S1 const_data_ptr, S2 aten.storage_offset / sym_storage_offset /
#   __cuda_array_interface__, S3 argument aliasing (is, is_set_to, _is_alias_of), S4
#   output_nr, S5 _version of a mark_static / static_argnames argument, S6 _is_view of a
#   parameter argument then its view, S7 a TorchScript helper, S8 an unowned Parameter's
#   class [finding: silent]; E1 explain on a nested argument [finding]; controls: the fix's
#   own reads refused, aliasing at the first call caught, a parameter's reads graphed, a
#   buffer's _version refused.
# b_models: LSTM, GRU, MHA, TransformerEncoderLayer, checkpoint, full backward hook, HF GPT-2 /
#   Llama, timm ResNet: the same plan as with Probe.read_metadata off [control].
# c_triton: L1 a Triton kernel on an argument refused since the change [finding: loud];
#   controls: the same with read_metadata off, a kernel on a made tensor.
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hunt8c/$1.py" 2>"/tmp/review_hunt8c_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hunt8c_$1.err")"
    fi
}
run a_checks 18
run b_models 24
run c_triton 14
exit 0
