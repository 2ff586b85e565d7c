"""GPU reproduction (review of caea02e, fix-capture2): the share accounting of CudaBackend's
failure paths. One GPU; run from the repository root:

    python .ci/review/capture/r3_share_accounting.py

Each scenario runs in a subprocess (an over-released pool aborts the process when its last
holder, the keeper graph, is destroyed: TORCH_INTERNAL_ASSERT(uc >= 0) inside ~CUDAGraph ->
std::terminate). Prints PASS/FAIL lines; FAIL = the finding reproduces.

A  real torch, no simulation: capture_begin raises BEFORE CUDACachingAllocator::
   beginAllocateToPool took a share (create_or_incref_pool's INTERNAL_ASSERT(use_count > 0): a
   plain pool id whose only graph was reset, no empty_cache since). _abandon's new
   unconditional _cuda_releasePool then fails its own INTERNAL_ASSERT: a raw RuntimeError
   instead of CaptureFailed, and _restore_generator is skipped (torch <= 2.12: capture_prologue
   ran, the generator stays in capture mode: torch.randn fails afterwards). The parent commit
   raised CaptureFailed here.
B  simulated torch <= 2.12 failure before beginAllocateToPool (CUDAGeneratorState::
   register_graph's assertNotCapturing / its at::empty OOM, capture_prologue's fill_): a
   CUDAGraph subclass raises in capture_begin before calling torch. With a keeper Pool, _abandon
   releases a share nobody took: the pool's count is one short; dropping the pool aborts.
C  simulated failure in capture_end AFTER torch set capture_ended_ (cudaGraphInstantiate failing,
   e.g. out of memory, keep_graph=False): torch's graph holds its share and gives it back when
   destroyed, but CudaBackend treats it as not ended and _recover releases it too; the graph is
   kept in Pool.failed, so the double release lands when the pool is dropped: abort.
   (Pre-existing: the parent did the same, destroying the graph at once.)
"""
import gc
import subprocess
import sys


def scenario(which: str) -> None:
    import torch
    from cudagraphify import _capture
    from cudagraphify._errors import CaptureFailed

    dev = torch.device("cuda", 0)
    be = _capture.default_backend()
    x = torch.ones(1 << 16, device=dev)

    class Flaky(torch.cuda.CUDAGraph):
        begin_raises = False
        end_raises = False

        def capture_begin(self, *a, **k):
            if Flaky.begin_raises:
                Flaky.begin_raises = False
                raise RuntimeError("Cannot register the state during capturing stage. "
                                   "(simulated: raised before beginAllocateToPool)")
            return super().capture_begin(*a, **k)

        def capture_end(self):
            super().capture_end()
            if Flaky.end_raises:
                Flaky.end_raises = False
                raise RuntimeError("CUDA error: out of memory (simulated: cudaGraphInstantiate "
                                   "failed after capture_ended_ was set)")

    def attempt(fn, pool):
        try:
            be.capture(fn, dev, pool=pool)
            return "no failure"
        except CaptureFailed as e:
            return f"CaptureFailed: {e}"
        except Exception as e:  # noqa: BLE001
            return f"RAW {type(e).__name__}: {str(e).splitlines()[0][:200]}"

    if which == "A":
        pid = torch.cuda.graph_pool_handle()
        g, out = be.capture(lambda: x * 2, dev, pool=pid)
        g.release()
        del g, out
        got = attempt(lambda: x * 3, pid)
        print(f"INFO [A]: capture into a pool id whose use count is 0: {got}")
        print(f"{'PASS' if got.startswith('CaptureFailed') else 'FAIL'}: [A] a capture_begin that "
              "raises before taking a share gives CaptureFailed (not a raw error from _abandon)")
        try:
            torch.randn(4, device=dev)
            torch.cuda.synchronize()
            print("PASS: [A] random ops work afterwards")
        except Exception as e:  # noqa: BLE001
            print(f"FAIL: [A] random ops fail afterwards: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160]}")
        return

    torch.cuda.CUDAGraph = Flaky  # (capture() looks it up at call time)
    pool = be.new_pool(dev)
    g1, out1 = be.capture(lambda: x * 2, dev, pool=pool)
    if which == "B":
        Flaky.begin_raises = True
    else:
        Flaky.end_raises = True
    got = attempt(lambda: x * 3, pool)
    print(f"INFO [{which}]: failing capture: {got}; pool retired={pool.retired}")
    g1.release()
    del g1, out1
    gc.collect()
    torch.cuda.synchronize()
    print(f"INFO [{which}]: dropping the pool (its keeper graph and Pool.failed)", flush=True)
    del pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(f"PASS: [{which}] the pool was dropped without an abort (its use count was right)",
          flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        scenario(sys.argv[1])
    else:
        for arg in ("A", "B", "C"):
            r = subprocess.run([sys.executable, __file__, arg], capture_output=True, text=True,
                               timeout=300)
            sys.stdout.write(r.stdout)
            if r.returncode:
                tail = " | ".join(r.stderr.strip().splitlines()[-4:])
                print(f"FAIL: [{arg}] process died (rc={r.returncode}): {tail[-600:]}")
