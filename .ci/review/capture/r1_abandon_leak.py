"""R1 (leak): a capture whose capture_begin raises (a retired pool, still captured into by the
owners that keep their pool: _rebase.Family.pool, _segrun.SegmentRun.pool) goes through
CudaBackend._abandon, which never gives back the share of the pool that the failed
capture_begin took (CUDACachingAllocator::beginAllocateToPool calls create_or_incref_pool
BEFORE its "already recording" check). The pool's use count then never reaches 0: after every
graph of the pool (and its keeper) is gone, empty_cache() cannot release its segments.

Control: the same scenario without the capture into the retired pool: memory comes back.
Run: python .ci/review/capture/r1_abandon_leak.py   (one GPU)
Prints PASS/FAIL per scenario (each in a subprocess)."""
import gc
import subprocess
import sys

MIB = 1 << 20
BIG = 256 * MIB  # an intermediate of the graph captured into the pool


def scenario(into_retired: bool) -> None:
    import torch
    from cudagraphify import _capture
    from cudagraphify._errors import CaptureFailed

    dev = torch.device("cuda", 0)
    be = _capture.default_backend()
    x = torch.ones(BIG // 4, device=dev)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()

    pool = be.new_pool(dev)
    pid = tuple(pool)

    def good():
        t = x * 2          # BIG bytes of intermediate, allocated in the pool
        return t.sum()

    g1, out1 = be.capture(good, dev, pool=pool)

    def syncs():
        t = x * 3
        if bool(t.sum() > 0):  # host sync: invalidates the capture
            t = t + 1
        return t

    try:
        be.capture(syncs, dev, pool=pool)
        print("INFO: the syncing capture did not fail (unexpected)")
    except CaptureFailed as e:
        print(f"INFO: capture that syncs failed as expected: {e}")
    print(f"INFO: pool retired = {getattr(pool, 'retired', None)}")

    if into_retired:
        # what Family (second state into family.pool) and SegmentRun (next segment into
        # self.pool) do: they do not look at ``retired``
        for i in range(3):
            try:
                be.capture(good, dev, pool=pool)
                print(f"INFO: capture {i} into the retired pool succeeded (begin did not fail)")
            except CaptureFailed as e:
                print(f"INFO: capture {i} into the retired pool: CaptureFailed: {e}")
            except Exception as e:  # noqa: BLE001
                print(f"INFO: capture {i} into the retired pool raised {type(e).__name__}: {e}")

    g1.release()
    del g1, out1, pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pid]
    after = torch.cuda.memory_reserved()
    tag = "into retired pool" if into_retired else "control"
    ok = after - base < 64 * MIB and not left
    print(f"{'PASS' if ok else 'FAIL'}: [{tag}] the pool's memory is released once its graphs "
          f"are gone (reserved {base / MIB:.0f} -> {after / MIB:.0f} MiB, "
          f"{len(left)} segment(s) of the pool left, {sum(s['total_size'] for s in left) / MIB:.0f} MiB)")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        scenario(sys.argv[1] == "1")
    else:
        for arg in ("0", "1"):
            r = subprocess.run([sys.executable, __file__, arg], capture_output=True, text=True)
            sys.stdout.write(r.stdout)
            if r.returncode:
                print(f"FAIL: scenario {arg} crashed (rc={r.returncode}):\n{r.stderr[-2000:]}")
