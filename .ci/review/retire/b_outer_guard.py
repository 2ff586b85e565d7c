"""R1: an outer graph captured while a piece of another root was live; the piece is retired;
the next module-state epoch bump (model.eval()) finds its forward "replaced": the outer graph is
captured again and the stale one stays cached. RETIRE_PIECES off: the control."""
import torch

import cudagraphify as cg
from cudagraphify import _wrap
from common import Outer, check, counters, force_verdict, guarded, pair, same


def run(retire):
    _wrap.RETIRE_PIECES = retire
    force_verdict(True)
    ref, g = pair()
    ok = same(g, ref, calls=2)  # planned: a live, trial under way
    outer, outer_ref = cg.graphify(Outer(g.a)), Outer(ref.a)
    ok &= same(outer, outer_ref, calls=3)
    ok &= same(g, ref, calls=10)  # a given back (and retired when on)
    for _ in range(3):
        outer.eval()
        ok &= same(outer, outer_ref)
    s = cg.stats(outer)
    tag = "change" if retire else "control, retire off"
    check(ok, f"R1 ({tag}): outer and root equal eager bitwise", counters(outer))
    check((s.captures, s.graphs) == (1, 1),
          f"R1 ({tag}): outer graph not re-captured after the piece's retirement + eval()",
          counters(outer))


guarded("R1 change", lambda: run(True))
guarded("R1 control", lambda: run(False))
