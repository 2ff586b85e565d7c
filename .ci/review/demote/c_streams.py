"""Streams (CUDA only; INFO lines on the CPU double). Suspected, not reproduced on a CPU.

S1 (c6fd56d): a region graph blocked by a later graph's held output is released at once
(``region.cache_for(self).discard(entry)`` in _engine._replay), without the ``drain`` every
other release path makes (GraphedState.release, _judge, GraphRegion._release). If its last
replay, on another stream, is still queued, its copy-in buffer (made on the default stream,
never ``record_stream``-ed) goes back to the allocator while that replay will still write it:
the eager run of the releasing call may be handed that memory, and the queued copy-in then
overwrites its result. Expected: PASS if the hazard does not show, FAIL if it does.

S2 (not from the reviewed commits, the same kind of ordering): ``protect_before`` moves a
held output to a copy (``Slot.protect``: ``storage.clone()`` on the caller's stream) before
``_replay`` orders the caller's stream after the stream that replayed last: a copy made
while that replay is still queued holds the older values."""
from common import GPU, cg, check, copy, guarded, info, nn, sync, torch

N, D = 2048, 1024
SLEEP = 400_000_000  # cycles: keeps the side stream busy for a while (~0.2 s)


def _pair():
    torch.manual_seed(0)
    f, g = nn.Linear(D, D).cuda(), nn.Linear(D, D).cuda()
    return (copy.deepcopy(f), copy.deepcopy(g)), (cg.graphify(f), cg.graphify(g))


def s1_released_while_in_flight():
    (rf, rg), (gf, gg) = _pair()
    xs = [torch.randn(N, D, device="cuda") for _ in range(3)]
    want = [rf(x) for x in xs]
    side = torch.cuda.Stream()
    with cg.graph_region() as region:
        a = gf(xs[0])
        b = gg(a)  # F captured first, then G (reads F's output in place)
        del a, b
        sync()
        entry = region.cache_for(gf._cudagraphify_state).graphs()[0]
        buf = entry._copy_in[0][1].data_ptr() if entry._copy_in else None
        torch.cuda.empty_cache()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP)
            a1 = gf(xs[1])  # F's copy-in and replay, queued behind the sleep
            b1 = gg(a1)
            view = b1[:1]  # a view of G's output: blocks F, captured before G
            del a1, b1
        a2 = gf(xs[2])  # default stream: F blocked -> released -> run eagerly
        landed = buf is not None and a2.data_ptr() == buf
        sync()
        ok = torch.equal(a2, want[2])
        del view
    recaptured = gf._cudagraphify_state._recaptures
    check(ok, "S1 a blocked region graph released while its replay on another stream is "
          "queued: the releasing call's eager result",
          f"{'equal' if ok else 'differs from eager'}; result on the released copy-in buffer: "
          f"{landed}; recaptures={recaptured}")


def s2_protect_before_ordering():
    (rf, _), (gf, _) = _pair()
    xs = [torch.randn(N, D, device="cuda") for _ in range(3)]
    want = [rf(x) for x in xs]
    side = torch.cuda.Stream()
    with cg.graph_region():
        a0 = gf(xs[0])
        del a0
        sync()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP)
            a1 = gf(xs[1])  # replays on the side stream, behind the sleep; a1 held
        a2 = gf(xs[2])  # default stream: a1 moved to a copy first, then the replay
        sync()
        ok1, ok2 = torch.equal(a1, want[1]), torch.equal(a2, want[2])
    check(ok1 and ok2, "S2 (pre-existing) an output held from a replay on another stream, "
          "moved to a copy by the next call",
          f"held output {'equal' if ok1 else 'differs (the older values)'}; new output "
          f"{'equal' if ok2 else 'differs'}")


if not GPU:
    info("S1/S2 stream checks need CUDA: skipped on the CPU double")
else:
    guarded("S1 a blocked region graph released while its replay is queued",
            s1_released_while_in_flight)
    guarded("S2 (pre-existing) a held output moved to a copy before the stream order",
            s2_protect_before_ordering)
