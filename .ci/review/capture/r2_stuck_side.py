"""R2 (crash): a capture left open on the side stream (capture_end raises before
cudaStreamEndCapture: fn() leaves another stream current, "Capture must end on the same stream
it began on"). The commit's _fresh_side is meant to replace such a side stream, but
CudaBackend.capture's ``finally: cur.wait_stream(side)`` runs first: it records an event on the
still-capturing side stream and makes the caller's stream wait on it, which
 - on the legacy default stream raises (legacy stream cannot depend on a capture): the raw
   RuntimeError replaces the CaptureFailed and _recover/_fresh_side never run;
 - on a user stream joins that stream into the dead capture: _restore_generator then waits
   the new side stream on it and capture_begin fails on it (raw RuntimeError), and the user's
   stream stays capturing.
Also, the replaced stream is a torch pool stream (torch.cuda.Stream() hands it out again after
32 more Stream() calls) still in capture mode.

Each scenario runs in a subprocess. Expected (PASS): CaptureFailed, nothing left capturing,
CUDA usable, a later capture works. Run from the repository root: python .ci/review/capture/r2_stuck_side.py"""
import subprocess
import sys


def scenario(which: str) -> None:
    import torch
    from cudagraphify import _capture
    from cudagraphify._errors import CaptureFailed

    dev = torch.device("cuda", 0)
    be = _capture.default_backend()
    x = torch.ones(16, device=dev)
    other = torch.cuda.Stream()
    user = torch.cuda.Stream()

    def leaves_other_stream_current():
        y = x * 2
        torch.cuda.set_stream(other)  # (not restored: capture_end sees another stream)
        return y

    def cap(fn, pool=None):
        return be.capture(fn, dev, pool=pool)

    raised = None
    try:
        if which == "user":
            with torch.cuda.stream(user):
                cap(leaves_other_stream_current, be.new_pool(dev))
        else:
            cap(leaves_other_stream_current, be.new_pool(dev))
    except CaptureFailed as e:
        raised = f"CaptureFailed: {e}"
    except Exception as e:  # noqa: BLE001
        raised = f"RAW {type(e).__name__}: {str(e).splitlines()[0]}"
    torch.cuda.set_stream(torch.cuda.default_stream(dev))
    print(f"INFO [{which}]: capture raised {raised}")
    print(f"{'PASS' if raised and raised.startswith('CaptureFailed') else 'FAIL'}: [{which}] "
          "a failed capture raises CaptureFailed (not a raw CUDA error)")

    def capturing(s):
        with torch.cuda.stream(s):
            return torch.cuda.is_current_stream_capturing()

    # (one side stream per device and thread: every thread's)
    sides = list(be.side_streams.values())
    stuck = [s for s in [user, *sides] if capturing(s)]
    print(f"{'PASS' if not stuck else 'FAIL'}: [{which}] no stream left capturing "
          f"(user stream capturing={capturing(user)}, side streams capturing="
          f"{[capturing(s) for s in sides]})")
    try:
        torch.cuda.synchronize()
        ok = (torch.ones(3, device=dev) * 2).sum().item() == 6
        torch.randn(4, device=dev)
        with torch.cuda.stream(user):
            ok &= (torch.ones(3, device=dev) * 3).sum().item() == 9
        torch.cuda.synchronize()
        print(f"{'PASS' if ok else 'FAIL'}: [{which}] CUDA usable afterwards (default and user stream)")
    except Exception as e:  # noqa: BLE001
        print(f"FAIL: [{which}] CUDA unusable afterwards: {type(e).__name__}: {str(e).splitlines()[0]}")
    try:
        g, out = cap(lambda: x * 5, be.new_pool(dev))
        g.replay()
        torch.cuda.synchronize()
        print(f"{'PASS' if torch.equal(out, x * 5) else 'FAIL'}: [{which}] a later capture works")
    except Exception as e:  # noqa: BLE001
        print(f"FAIL: [{which}] a later capture fails: {type(e).__name__}: {str(e).splitlines()[0]}")
    # the replaced side stream comes back from torch's stream pool
    back = [torch.cuda.Stream() for _ in range(40)]
    print(f"{'PASS' if not any(capturing(s) for s in back) else 'FAIL'}: [{which}] no stream "
          "handed out by torch.cuda.Stream() afterwards is in capture mode")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        scenario(sys.argv[1])
    else:
        for arg in ("default", "user"):
            r = subprocess.run([sys.executable, __file__, arg], capture_output=True, text=True,
                               timeout=300)
            sys.stdout.write(r.stdout)
            if r.returncode:
                print(f"FAIL: [{arg}] crashed (rc={r.returncode}):\n{r.stderr[-2000:]}")
