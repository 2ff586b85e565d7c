"""A thread that replayed last enters its run unordered (enter_run's ``_stream_token != token``).

cd1f035 makes the region's last stream MULTI_STREAM when a thread enters a run of the callable
while another thread runs it on another stream: then every replay orders after the others'
streams. But enter_run skips that where the region's last stream is the entering thread's own:

  0. B runs the model alone (the region's last stream: B's)
  1. A starts a run (nothing replayed yet): no MULTI (A alone)
  2. B starts a run: the last stream is B's own: no MULTI
  3. A replays a (ordered after B: last = A) and holds its output
  4. B's run: a runs eagerly (held by A), b replays (ordered after A: last = B)
  5. A queues a ~300 ms kernel, then y = y * 2 + 1 (reads a's output), drops it
  6. B runs again: the last stream is B's own: a replays on B's stream at once (fast path),
     overwriting a's output before A's queued op reads it
  7. A's result is built on B's x.

- [finding] A's, B's outputs bitwise eager's with B having replayed last before step 1.
- [control] the same where the main thread replayed last (B's entry then sets MULTI).
On the CPU double (no streams: A's op runs at once) both PASS by construction.
CPU reproduction (the orders recorded): tests/test_review_release.py::
test_finding_a_thread_that_replayed_last_enters_unordered."""
import copy
import threading

import torch
from torch import nn

import cudagraphify as cg
from common import (CPU, DEV, Worker, arm, check, finish, gpu_sleep, info, new_stream, pause,
                    sync)

W, N = (64, 16) if CPU else (2048, 1024)


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x):
        pause("start")
        y = self.a(x)
        if bool((y > 1e9).any()):  # a host sync: piecewise, a and b chain in the implicit region
            raise AssertionError
        pause("held")
        if threading.current_thread().name == "A":
            gpu_sleep(300)
        y = y * 2 + 1  # (queued behind the sleep on A's stream; a's output dropped)
        pause("dropped")
        return self.b(y)


def scenario(b_first: bool):
    torch.manual_seed(0)
    ref = Root().to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(4):  # (main thread: the plan, then a and b captured and replaying)
            x = torch.randn(N, W, device=DEV)
            assert torch.equal(g(x), ref(x))
    sync()
    A, B = Worker("A", new_stream()), Worker("B", new_stream())
    errors, out = [], {}
    a_start, a_held, a_drop = arm("A", "start"), arm("A", "held"), arm("A", "dropped")
    b_start = None
    try:
        if b_first:
            box = B.run(lambda: g(torch.randn(N, W, device=DEV)))
            errors += [box["err"]] if "err" in box else []
        sync()
        xa, xb1, xb2 = (torch.randn(N, W, device=DEV) for _ in range(3))
        sync()
        b_start = arm("B", "start")  # (after B's run alone)
        box_a, done_a = A.submit(lambda: g(xa))
        ok = a_start[0].wait(30)
        box_b1, done_b1 = B.submit(lambda: g(xb1))
        ok = ok and b_start[0].wait(30)
        a_start[1].set()
        ok = ok and a_held[0].wait(30)
        b_start[1].set()
        ok = ok and done_b1.wait(30)
        a_held[1].set()
        ok = ok and a_drop[0].wait(30)
        box_b2 = B.run(lambda: g(xb2))
        a_drop[1].set()
        ok = ok and done_a.wait(60)
        if not ok:
            errors.append("a step timed out")
        for k, box in (("a", box_a), ("b1", box_b1), ("b2", box_b2)):
            if "err" in box:
                errors.append(f"{k}: {box['err']}")
            else:
                out[k] = box["out"]
        sync()
    finally:
        for e in (a_start, a_held, a_drop, b_start):
            if e is not None:
                e[1].set()
        A.stop()
        B.stop()
    with torch.no_grad():
        oks = [k in out and torch.equal(out[k], ref(x)) for k, x in
               (("a", xa), ("b1", xb1), ("b2", xb2))]
    token = g._cudagraphify_state._chain._stream_token
    return errors, oks, token


def main():
    info(f"DEV={DEV} W={W} N={N}" + (" (no streams here: both checks pass by construction)"
                                     if CPU else ""))
    errors, oks, token = scenario(b_first=True)
    check(not errors and all(oks),
          "[finding] B replayed last, then A's run and B's start: B's later replay of a is not "
          "ordered after A's stream, where A's queued op still reads a's output",
          f"errors={errors[:2]} A,B1,B2 bitwise eager's={oks} last stream={token}")
    errors, oks, token = scenario(b_first=False)
    check(not errors and all(oks), "[control] the same where the main thread replayed last "
          "(B's entry sets MULTI_STREAM)", f"errors={errors[:2]} A,B1,B2 bitwise eager's={oks}")
    finish()


if __name__ == "__main__":
    main()
