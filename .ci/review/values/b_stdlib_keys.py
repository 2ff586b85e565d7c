"""Stdlib immutables and frozen dataclasses as constants (findings V5-V8 of
tests/test_review_values.py), against eager.

Decimal and datetime are constants keyed by ``==`` (strict_key's fallback ``(type, value)``):
``Decimal('-0') == Decimal('0')``; aware datetimes of one instant are equal in any zone; a
frozen dataclass with ``eq=False`` (identity semantics) is keyed by its fields.
Checks (``f(x, s)`` graphed, three calls with one value, then two with another; 4096 wide):
  [finding] Decimal('0') then Decimal('-0'): 1 / (|x| * float(s)), positional, keyword, and
            inside a tuple (V5);
  [finding] datetime 00:00 UTC then 01:00 +01:00 (one instant): x * s.hour (V6);
  [finding] two instances of a frozen eq=False dataclass, equal fields: x * table[s] (V7);
  [finding] a NamedTuple subclass in a frozen dataclass, an attribute set on it after three
            calls: x * getattr(s.nt, 'gain', 1.0) (V8, keyword);
  [control] float 0.0 then -0.0 (positional, keyword), complex 0j then -0j (imag),
            Decimal('0.5') then Decimal('2') (other values).
Run from the repository root: python3 .ci/review/values/b_stdlib_keys.py
"""
import dataclasses
import datetime
import os
import typing
import sys
from decimal import Decimal as D

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("b_stdlib_keys.py")
import torch  # noqa: E402

import cudagraphify as cg  # noqa: E402
from a_numpy_keys import arg_case  # noqa: E402


@dataclasses.dataclass(frozen=True, eq=False)
class Tag:
    name: str


TA, TB = Tag("head"), Tag("head")
SCALE = {TA: 1.0, TB: 2.0}  # (hashed by identity)


class NT(typing.NamedTuple):
    a: float


class NTSub(NT):  # (has a __dict__)
    pass


@dataclasses.dataclass(frozen=True)
class Holds:
    nt: typing.Any


def recip(x, s):
    return 1 / (x.abs() * float(s))


if __name__ == "__main__":
    dec = [D("0")] * 3 + [D("-0")] * 2
    arg_case("finding", "Decimal 0 then -0, positional (V5)", recip, dec)
    arg_case("finding", "Decimal 0 then -0, keyword (V5)", recip, dec, kw=True)
    arg_case("finding", "(Decimal 0,) then (Decimal -0,) (V5)", lambda x, s: recip(x, s[0]),
             [(d,) for d in dec])
    utc, p1 = datetime.timezone.utc, datetime.timezone(datetime.timedelta(hours=1))
    arg_case("finding", "datetime 00:00 UTC then 01:00 +01:00, x * s.hour (V6)",
             lambda x, s: x * s.hour, [datetime.datetime(2020, 1, 1, 0, tzinfo=utc)] * 3
             + [datetime.datetime(2020, 1, 1, 1, tzinfo=p1)] * 2)
    arg_case("finding", "frozen eq=False dataclass, another instance, equal fields (V7)",
             lambda x, s: x * SCALE[s], [TA] * 3 + [TB] * 2)
    nt = NTSub(1.0)

    def set_gain():
        nt.gain = 3.0
    arg_case("finding", "NamedTuple subclass in a frozen dataclass, attribute set (V8)",
             lambda x, s: x * getattr(s.nt, "gain", 1.0), [Holds(nt)] * 6, kw=True,
             before={3: set_gain})
    zeros = [0.0] * 3 + [-0.0] * 2
    arg_case("control", "float 0.0 then -0.0, positional", recip, zeros)
    arg_case("control", "float 0.0 then -0.0, keyword", recip, zeros, kw=True)
    arg_case("control", "complex 0j then -0j imag", lambda x, s: 1 / (x.abs() * s.imag),
             [0j] * 3 + [complex(0, -0.0)] * 2)
    arg_case("control", "Decimal 0.5 then 2", recip, [D("0.5")] * 3 + [D("2")] * 2)
    C.finish("b_stdlib_keys.py")
