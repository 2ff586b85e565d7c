"""Arguments read in place (``static_argnames``, ``mark_static``) whose conj or neg bit changes
(finding F4 of tests/test_review_hunt3.py), against eager.

Such an argument is keyed by its address and layout: ``buf.conj()`` (a conj-bit view of the same
memory, same shape and strides) after captures with ``buf`` replays the graph that reads the raw
memory, unconjugated; ``buf.conj().imag`` (a neg-bit view) after ``buf.imag`` likewise.
Checks (complex64, 4096 elements, three calls with ``buf`` first: warm-up, capture, replay):
  [finding] static_argnames, buf -> buf.conj();
  [finding] mark_static, buf -> mark_static(buf.conj());
  [finding] static_argnames, buf.imag -> buf.conj().imag (neg bit);
  [control] the same argument copied (not static), buf -> buf.conj().
Run from the repository root: python3 .ci/review/hunt3/c_static_conj.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("c_static_conj.py")
import torch  # noqa: E402

import cudagraphify as cg  # noqa: E402

N = 4096


def plus(x, buf):
    return x * 2 + buf


def case(label, name, static, first, later, mark=False, real_x=False):
    g = cg.graphify(plus, static_argnames=("buf",)) if static else cg.graphify(plus)
    torch.manual_seed(0)
    buf = torch.randn(N, dtype=torch.complex64, device=C.DEV)
    ok, why = True, ""
    for i in range(6):
        x = torch.randn(N, device=C.DEV) if real_x else \
            torch.randn(N, dtype=torch.complex64, device=C.DEV)
        b = first(buf) if i < 3 else later(buf)
        if mark:
            b = cg.mark_static(b)
        got, want = g(x, b), plus(x, b)
        C.sync_all()
        ok, why = C.same(got, want)
        if not ok:
            why = f"call {i}: {why}"
            break
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


if __name__ == "__main__":
    case("finding", "static_argnames, buf -> buf.conj()", True, lambda b: b, lambda b: b.conj())
    case("finding", "mark_static, buf -> buf.conj()", False, lambda b: b, lambda b: b.conj(),
         mark=True)
    case("finding", "static_argnames, buf.imag -> buf.conj().imag (neg bit)", True,
         lambda b: b.imag, lambda b: b.conj().imag, real_x=True)
    case("control", "copied argument, buf -> buf.conj()", False, lambda b: b,
         lambda b: b.conj())
    C.finish("c_static_conj.py")
