"""Review of 7ec8df7 + dadf0ac (CAPTURED_ELSEWHERE). CPU side: tests/test_review_elsewhere.py.

Thread A captures a torch.cuda.graph of its own (capture_error_mode="thread_local") while
thread B, on its own stream, calls the same graphified callable:
  newsig_same / newsig_own [finding]: B's call has a shape not seen before: cudagraphify
    captures it, and CudaBackend.capture begins with torch.cuda.synchronize(), a device-wide
    sync during A's capture (CUDA refuses it: B raises, A's capture is invalidated). A on the
    stream that replayed last (stream=s) / on torch.cuda.graph's own stream.
  release_multi [finding]: pieces; B's run during A's capture (eager: CAPTURED_ELSEWHERE)
    leaves the root's region MULTI_STREAM; B then moves a piece's parameters: the release
    drains MULTI_STREAM = torch.cuda.synchronize(device) during A's capture.
  after_capture [control]: B's call during the capture runs eagerly, and B's calls after it
    replay again (bitwise eager, graphs replayed).
Every output is compared bitwise with an eager twin afterwards."""
import torch

from common import capture_race, check, finish, isolated, rand


def newsig(same_stream):
    def between(g, call):
        out = []
        for _ in range(3):  # (first sight, then a capture of the new shape)
            x = rand(5)
            out.append((x, call(g, x)))
        return out
    where = "the stream that replayed last" if same_stream else "its own capture stream"
    capture_race("whole", same_stream, between,
             f"[finding] whole, A captures on {where}, B calls a new shape")


def release_multi():
    def between(g, call):
        out = []
        x = rand()
        out.append((x, call(g, x)))
        for p in g.a.parameters():
            p.data = p.data.clone()  # (new memory: the piece's graphs are released)
        x = rand()
        out.append((x, call(g, x)))
        return out
    capture_race("pieces", True, between,
             "[finding] pieces, B's run during A's capture, then a piece's parameters moved")


def after_capture(kind):
    import cudagraphify as cg

    def between(g, call):
        x = rand()
        return [(x, call(g, x))]
    tag = f"[control] {kind}, B's calls after A's capture"
    ref, g, call = capture_race(kind, True, between, f"[control] {kind}, B during A's capture")
    stats = g if kind == "whole" else g.a
    before = cg.stats(stats).replays
    sb = torch.cuda.Stream()
    sb.wait_stream(torch.cuda.current_stream())
    pairs = []
    with torch.no_grad(), torch.cuda.stream(sb):
        for _ in range(3):
            x = rand()
            pairs.append((x, call(g, x)))
    torch.cuda.current_stream().wait_stream(sb)
    torch.cuda.synchronize()
    with torch.no_grad():
        check(all(torch.equal(y, call(ref, x)) for x, y in pairs), f"{tag}: eager's bits")
    check(cg.stats(stats).replays > before, f"{tag}: the graphs replay again",
          f"{cg.stats(stats).replays - before} replays")


isolated({"newsig_same": lambda: newsig(True), "newsig_own": lambda: newsig(False),
          "release_multi": release_multi,
          "after_whole": lambda: after_capture("whole"),
          "after_pieces": lambda: after_capture("pieces")}, timeout=10)
finish()
