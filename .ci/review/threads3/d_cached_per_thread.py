"""[cost] Memory the caching allocator keeps per side stream: one side stream per thread keeps
one set of cached warm-up blocks per thread.

The caching allocator reuses a freed block only for allocations on the stream it was allocated
on. A first call's real call (and its extra warm-ups) allocate their transients on the side
stream; once freed they stay reserved, cached for that stream. With one side stream per device
(before 6c0e2ee) every thread's later first calls reused them; with one per thread each thread
that makes a first call caches its own (up to torch's 32 pool streams), so reserved memory grows
with the number of threads making first calls (until empty_cache; and while any thread captures,
the allocator does not free cached blocks to satisfy an allocation: an OOM there instead).

Measured from torch.cuda.memory._snapshot(): bytes of default-pool segments cached on each
thread's side stream after 4 first calls (transients about 2 x 64 MiB each), made on one thread,
then on 4 short-lived threads. Lines:
- [cost] 4 threads cache at most 1.5x what one thread caches (FAIL = the growth shown).
Run from the repository root: python3 .ci/review/threads3/d_cached_per_thread.py
"""
import copy
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("d_cached_per_thread.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402
import cudagraphify as cg  # noqa: E402

if C.CPU:
    C.info("d_cached_per_thread: no caching allocator on the CPU double: nothing measured")
    sys.exit(0)

MiB = 1 << 20
# 4 signatures (4 first calls), largest first: on one stream each later call fits in the blocks
# the first one cached
ROWS = (2072, 2064, 2056, 2048)


def cached_on(tokens: set) -> int:
    """Bytes of default-pool segments (graph pools excluded) on the streams ``tokens``."""
    total = 0
    for seg in torch.cuda.memory._snapshot()["segments"]:
        pool = tuple(seg.get("segment_pool_id", (0, 0)) or (0, 0))
        if pool == (0, 0) and seg.get("stream") in tokens:
            total += seg["total_size"]
    return total


def phase(ref, threads: int) -> tuple[int, str]:
    g = cg.graphify(copy.deepcopy(ref))
    tokens, errors = set(), []

    def work(rows_list):
        try:
            with torch.no_grad():
                for rows in rows_list:
                    x = torch.randn(rows, 1024, device=C.DEV)
                    if not torch.equal(g(x), ref(x)):
                        errors.append(AssertionError(f"rows={rows}: output differs from eager"))
            tokens.add(C.side_token())
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(e)

    per = [ROWS[k::threads] for k in range(threads)]
    for rows_list in per:  # one after another: short-lived threads
        th = threading.Thread(target=work, args=(rows_list,))
        th.start()
        th.join(60)
    torch.cuda.synchronize()
    got = cached_on(tokens)
    cg.ungraphify(g)
    del g
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return got, (f"{type(errors[0]).__name__}: {errors[0]}" if errors else "")


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 8192), nn.GELU(), nn.Linear(8192, 1024)).to(C.DEV)
torch.cuda.empty_cache()
one, err1 = phase(model, 1)
four, err4 = phase(model, 4)
C.info(f"cached on the side streams after 4 first calls: one thread {one / MiB:.0f} MiB, four "
       f"threads {four / MiB:.0f} MiB (memory_reserved now {torch.cuda.memory_reserved() / MiB:.0f}"
       " MiB)")
C.check(not err1 and not err4, "[control] every first call's output as eager's", err1 or err4)
C.check(four <= 1.5 * one + 16 * MiB, "[cost] first calls on 4 short-lived threads cache at most "
        "1.5x the warm-up memory one thread caches",
        f"{four / MiB:.0f} MiB vs {one / MiB:.0f} MiB")
C.finish("d_cached_per_thread")
