"""R4/R5: the user's API on a retired piece: graphify(piece) then ungraphify(root);
explain(piece)."""
import torch

import cudagraphify as cg
from cudagraphify import _wrap
from common import DEV, check, counters, force_verdict, guarded, pair, same


def r4():
    force_verdict(True)
    ref, g = pair()
    ok = same(g, ref, calls=12)
    cg.graphify(g.a)  # (the retired piece: accepted)
    ok &= same(g.a, ref.a, calls=3)
    user = cg.stats(g.a)
    check(ok and user.graphs == 1, "R4: user's graphify of a retired piece replays, eager-equal",
          counters(g.a))
    cg.ungraphify(g)
    ok = same(g.a, ref.a, calls=3)
    check(ok and isinstance(g.a.__dict__.get("forward"), _wrap.GraphedForward),
          "R4: ungraphify(root) leaves the user's graphify of the piece",
          f"forward={type(g.a.__dict__.get('forward')).__name__}")


def r5():
    force_verdict(True)
    ref, g = pair()
    ok = same(g, ref, calls=12)
    first = str(cg.explain(g.a)).splitlines()[0]
    check(ok and "given back" in first, "R5: explain(retired piece) says given back",
          first[:90])


guarded("R4", r4)
guarded("R5", r5)
