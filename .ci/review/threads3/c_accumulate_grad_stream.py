"""[finding] Parameters' AccumulateGrad nodes made during a first call's real call live on that
thread's side stream, and every backward that reaches those parameters meanwhile, on ANY thread,
runs its accumulation there.

Autograd makes a leaf's AccumulateGrad node on the first use of the leaf while no node of it is
alive, and fixes the node's stream then: the current stream, i.e. the side stream when the use
is a first call's real call (``CudaBackend.warmup``; the real call uses the real parameters, not
the stand-ins). While that call's autograd graph is alive (the first call holds its result
through its own capture; the caller holds it until its backward), another thread's backward
through the same parameters (a shared model, tied weights, a regulariser or EMA computed on
another thread) enqueues ``param.grad += ...`` on the first-calling thread's side stream, and
that thread is capturing on it right then: the backward fails, or the accumulation is recorded
into that thread's graph (not run now, replayed with every later replay of it). 6c0e2ee gives
each thread its own stream but does not move these nodes off it.

Made deterministic: thread B makes a first call of a gated module ``g`` in grad mode (its real
call makes ``g``'s parameters' nodes on B's side stream; its capture then waits); the main
thread, holding ``g``'s parameter objects from before, backpropagates an L2 term of them.
``.grad`` are zeroed first, so the accumulation is an in-place add (a kernel on the node's
stream) whose absence shows.

Lines:
- [control] the main thread's own autograd graph over the parameters alive from before B's
  first call (the nodes then live on the main thread's stream): gradients as eager's.
- [finding] no such graph: the nodes are made on B's side stream.
Both also check B's output, B's own backward, and two more training steps of ``g``.
Run from the repository root: python3 .ci/review/threads3/c_accumulate_grad_stream.py
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("c_accumulate_grad_stream.py")
import torch  # noqa: E402
import cudagraphify as cg  # noqa: E402


def l2(params):
    return sum((p * p).sum() for p in params)


def scenario(nodes_from_main: bool) -> str:
    ref, g = C.pair(C.Gated, seed=0)
    params, ref_params = list(g.parameters()), list(ref.parameters())  # (an optimizer's view)
    C.zero_grads(ref, g)
    # the control: an autograd graph of the main thread's over the parameters, alive across
    # B's first call (the nodes are then made here, on this thread's current stream)
    keep = l2(params) * 0 if nodes_from_main else None
    keep_ref = l2(ref_params) * 0 if nodes_from_main else None
    xb = C.x_()
    reached, release = C.arm(g)
    state: dict = {}
    errors = []

    def thread_b():
        try:
            state["b"] = g(xb)  # grad mode: the real call (B's side stream), then the capture
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(("thread B's first call", e))
        finally:
            reached.set()

    th = threading.Thread(target=thread_b)
    th.start()
    try:
        if not reached.wait(20):
            return "thread B never reached its capture"
        time.sleep(0.05)  # (B's forward done on the GPU)
        try:
            l2(params).backward()  # accumulates into g's parameters' .grad
            C.sync()
            got = C.kept(params)
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(("main thread's backward", e))
    finally:
        release.set()
        th.join(30)
    C.disarm(g)
    C.sync_all()
    if errors:
        return C.first_error(errors)
    l2(ref_params).backward()
    why = C.grads_close(got, ref_params)
    if why:
        return f"the main thread's L2 gradients: {why} (accumulated into B's capture?)"
    want_b = ref(xb)
    if not torch.equal(state["b"], want_b):
        return "B's first call differs from eager"
    state["b"].sum().backward()  # B's first call's backward (on B's side stream)
    want_b.sum().backward()
    C.sync_all()
    why = C.grads_close(params, ref_params)
    if why:
        return f"after B's backward: {why}"
    del keep, keep_ref
    why = C.calls_match(ref, g, 2, grad=True)
    if why:
        return f"later training steps: {why}"
    C.info(f"g stats: captures={cg.stats(g).captures}, replays={cg.stats(g).replays}, "
           f"eager={cg.stats(g).eager}")
    cg.ungraphify(g)
    return ""


for label, from_main in (("[control] parameters' nodes made on the main thread before", True),
                         ("[finding] parameters' nodes made by thread B's first call", False)):
    try:
        why = scenario(from_main)
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e)[:200]}"
    C.check(not why, f"{label}: the main thread's backward through shared parameters while B "
            "captures: runs, gradients as eager's", why)
C.finish("c_accumulate_grad_stream")
