"""numpy scalars as constants (findings V1-V4 of tests/test_review_values.py), against eager.

strict_key keys a numpy scalar by ``(type, tobytes())``: not its unit or dtype; ``np.void`` is
taken for immutable, though it may hold an object or be a view of an array's row.
Checks (``f(x, s)`` graphed, three calls with one value, then two with another; 4096 wide):
  [finding] timedelta64(1, 's') then timedelta64(1, 'D'), positional and keyword (V1);
  [finding] np.void of ('x', f8) then the same bytes as ('x', i8) (V2);
  [finding] np.void holding a list, the list changed (V3);
  [finding] a module's np.void attribute (a row of an array), the array written (V4);
  [control] np.float32 0.0 then -0.0; np.float64 keyword (the fast path); the np.void
            argument written through its array (keyed again on each call).
Run from the repository root: python3 .ci/review/values/a_numpy_keys.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_numpy_keys.py")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 4096


def arg_case(label, name, f, values, kw=False, before=None):
    """``values``: a list; ``before``: {call index: callable run before that call}."""
    g = cg.graphify(f)
    ok, why = True, ""
    for i, v in enumerate(values):
        if before and i in before:
            before[i]()
        x = torch.randn(W, device=C.DEV)
        got = g(x, s=v) if kw else g(x, v)
        want = f(x, s=v) if kw else f(x, v)
        ok, why = C.same(got, want)
        if not ok:
            why = f"call {i}: {why}"
            break
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


def seconds(x, s):
    return x * float(s / np.timedelta64(1, "s"))


def field(x, s):
    return x * float(s["x"])


class RecAttr(nn.Module):
    def __init__(self, rec):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.rec = rec

    def forward(self, x):
        return self.lin(x) * float(self.rec["x"])


def attribute_case():
    torch.manual_seed(0)
    table = np.zeros(1, dtype=[("x", "f8")])
    table[0]["x"] = 1.0
    m = RecAttr(table[0]).to(C.DEV).eval()
    g = cg.graphify(m)
    ok, why = True, ""
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                table[0]["x"] = 5.0
            x = torch.randn(8, W, device=C.DEV)
            got = g(x)
            ok, why = C.same(got, m.lin(x) * float(m.rec["x"]))
            if not ok:
                why = f"call {i}: {why}"
                break
    name = "module attribute np.void (array row), array written (V4)"
    C.check(ok, f"[finding] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


if __name__ == "__main__":
    td = [np.timedelta64(1, "s")] * 3 + [np.timedelta64(1, "D")] * 2
    arg_case("finding", "timedelta64 1 s then 1 D, positional (V1)", seconds, td)
    arg_case("finding", "timedelta64 1 s then 1 D, keyword (V1)", seconds, td, kw=True)
    a = np.array([(1.0,)], dtype=[("x", "<f8")])[0]
    b = np.frombuffer(a.tobytes(), dtype=[("x", "<i8")])[0]
    arg_case("finding", "np.void ('x', f8) then the same bytes as ('x', i8) (V2)", field,
             [a] * 3 + [b] * 2)
    objs = np.zeros(1, dtype=[("o", object)])
    objs[0]["o"] = [1.0]
    v = objs[0]

    def change():
        v["o"][0] = 5.0
    arg_case("finding", "np.void holding a list, the list changed (V3)",
             lambda x, s: x * s["o"][0], [v] * 5, before={3: change})
    attribute_case()
    arg_case("control", "np.float32 0.0 then -0.0", lambda x, s: 1 / (x.abs() * float(s)),
             [np.float32(0.0)] * 3 + [np.float32(-0.0)] * 2)
    arg_case("control", "np.float64 keyword scale (fast path)", lambda x, s: x * s,
             [np.float64(0.125)] * 5, kw=True)
    table = np.zeros(1, dtype=[("x", "f8")])
    table[0]["x"] = 1.0
    row = table[0]

    def write():
        table[0]["x"] = 5.0
    arg_case("control", "np.void argument written through its array", field, [row] * 6,
             before={3: write})
    C.finish("a_numpy_keys.py")
