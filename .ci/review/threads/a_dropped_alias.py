"""A dropped alias still read by work queued on another thread's stream (implicit region).

8b11f19 keeps a piece from moving or overwriting an alias while another thread runs the root
and HOLDS it. Once that thread drops it (``y = y * 2 + 1``: the op reading it is queued on its
stream, the tensor is gone in Python), the slot's use count is back to its baseline: the other
thread's replay overwrites it at once. The region orders a replay only after the stream that
replayed last (``_engine._replay``: ``order_after(holder._stream_token)``); where that is the
replaying thread's own stream, nothing orders it after the first thread's queued op.

Steps (events in the forward, by thread name; streams of their own):
  A: y = a(x) [A's stream]; host sync; waits for B's first call
  B: call 1: a runs eagerly (A holds y: HELD_BY_ANOTHER_THREAD), b replays on B's stream
     (the stream that replayed last is now B's)
  A: a ~300 ms kernel, then y = y * 2 + 1 (queued behind it, on A's stream); y dropped
  B: call 2: a replays on B's stream (no wait: B replayed last; nothing holds a's output),
     overwriting a's output before A's queued op reads it
  A: b(y): A's result is built on B's x.

- [finding] A's result bitwise eager's (FAILS on a GPU: the queued op reads B's values).
- [control] the same with both threads on ONE stream (stream order saves it).
On the CPU double (no streams: A's op runs before y is dropped) both PASS by construction."""
import copy
import threading

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine
from common import CPU, DEV, check, finish, gpu_sleep, info, new_stream, on, sync, threads

W, N = (64, 16) if CPU else (1024, 256)
_PAUSE = {}  # (thread name, stage) -> (event set there, event waited for there)


def pause(stage):
    p = _PAUSE.get((threading.current_thread().name, stage))
    if p is not None:
        p[0].set()
        assert p[1].wait(30), stage


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x):
        y = self.a(x)
        if bool((y > 1e9).any()):  # a host sync: piecewise, a and b chain in the implicit region
            raise AssertionError
        pause("held")
        if threading.current_thread().name == "A":
            gpu_sleep(300)
        y = y * 2 + 1  # (queued behind the sleep on A's stream; a's output dropped)
        pause("dropped")
        return self.b(y)


def scenario(shared_stream: bool):
    torch.manual_seed(0)
    ref = Root().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(4):  # (the plan, then a and b captured and replaying)
            x = torch.randn(N, W, device=DEV)
            assert torch.equal(g(x), ref(x))
    sync()
    e = [threading.Event() for _ in range(4)]
    _PAUSE.clear()
    _PAUSE[("A", "held")] = (e[0], e[1])
    _PAUSE[("A", "dropped")] = (e[2], e[3])
    xa, xb1, xb2 = (torch.randn(N, W, device=DEV) for _ in range(3))
    sa = new_stream()
    sb = sa if shared_stream else new_stream()
    out = {}

    def a():
        with on(sa):
            out["a"] = g(xa)

    def b():
        with on(sb):
            assert e[0].wait(30)
            out["b1"] = g(xb1)
            e[1].set()
            assert e[2].wait(30)
            out["b2"] = g(xb2)
            e[3].set()

    errors = threads(a, b)
    sync()
    _PAUSE.clear()
    with torch.no_grad():
        oks = [k in out and torch.equal(out[k], ref(x)) for k, x in
               (("a", xa), ("b1", xb1), ("b2", xb2))]
    s = cg.stats(g.a)
    return errors, oks, s


def main():
    info(f"DEV={DEV} W={W} N={N}" + (" (no streams here: both checks pass by construction)"
                                     if CPU else ""))
    errors, oks, s = scenario(shared_stream=False)
    held = s.eager_calls.get(_engine.HELD_BY_ANOTHER_THREAD, 0)
    check(not errors and all(oks),
          "[finding] a's output dropped by A with an op still queued on A's stream reading it: "
          "B's replay on its own stream overwrites it first",
          f"errors={errors[:1]} A,B1,B2 bitwise eager's={oks} a: replays={s.replays} "
          f"held_by_another_thread={held}")
    errors, oks, s = scenario(shared_stream=True)
    check(not errors and all(oks), "[control] the same with both threads on one stream",
          f"errors={errors[:1]} A,B1,B2 bitwise eager's={oks}")
    finish()


if __name__ == "__main__":
    main()
