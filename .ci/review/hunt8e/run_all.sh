#!/usr/bin/env bash
# hunt-8e review (of 5dcf40f + f8c82f7's key item: a tensor passed twice gets ONE static copy,
# StaticInputs._build; no eager fast path for such a call): GPU reproductions of
# tests/test_review_hunt8e.py and GPU controls. Run from anywhere on the GPU machine (one GPU);
# well under a minute. One line per check: PASS/FAIL (INFO: numbers).
# [control] lines should PASS; [finding] lines FAIL where the finding holds.
# a_checks: S1 a chained output passed twice (graph_region per call / one region, a piecewise
#   plan's pieces) captured as (slot, copy), S2 g(x, kv=x) with static_argnames="kv" captured
#   as (copy, x), S3 cg.bucketed pads b(t, t) apart and takes the distinct calls' check
#   [finding: silent]; L1 nn.MultiheadAttention self-attention after a graphed piece (piecewise,
#   region) runs eagerly [finding: loud]; C1 the shared buffer copied in twice per replay
#   [finding: cost]; controls: f(t, t) outputs (copy_outputs True/False), training with a
#   repeated tensor (no grad: replays, bitwise grads; requires grad: refused), containers and
#   keywords, num_warmup_iters=3, read in place (parameter, static_argnames both, mark_static),
#   f(t, t) / f(t, t.clone()) alternating, a write to a repeated tensor, a chained output
#   passed once, capture_sizes, bucketed distinct calls, MHA self-attention alone.
# DEV=cpu: a smoke test on the CPU double of tests/conftest.py.
cd "$(dirname "$0")/../../.." || exit 1
run() {  # script, seconds
    timeout "$2" python3 ".ci/review/hunt8e/$1.py" 2>"/tmp/review_hunt8e_$1.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL $1 exited rc=$rc (124: timed out): $(tail -n 1 "/tmp/review_hunt8e_$1.err")"
    fi
}
run a_checks 35
exit 0
