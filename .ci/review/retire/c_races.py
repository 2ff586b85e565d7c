"""R2/R3: another thread's call landing inside the retirement (forced at the two windows a GIL
switch can hit: between Module._wrapped_call_impl's two reads of _compiled_call_impl, and
between _restore_forward's pop of forward and its store of the instance's own)."""
import copy

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _wrap
from common import (DEV, FORCED, _PAUSE, Root, check, counters, force_verdict, guarded, pair,
                    pause_here, same)


class PausedLinear(nn.Linear):
    def __getattribute__(self, name):
        value = super().__getattribute__(name)
        if name == "_compiled_call_impl" and value is not None:
            pause_here()
        return value


def r2(retire):
    _wrap.RETIRE_PIECES = retire
    force_verdict(False)
    ref, g = pair(Root, PausedLinear(64, 64))
    ok = same(g, ref, calls=3)
    st = g.a._cudagraphify_state

    def give_back():
        with st.lock:
            st.give_back(FORCED)

    _PAUSE.append(give_back)
    tag = "change" if retire else "control, retire off"
    try:
        with torch.no_grad():
            x = torch.randn(8, 64, device=DEV)
            got = g.a(x)
        check(ok and torch.equal(got, ref.a(x)),
              f"R2 ({tag}): a call racing the retirement returns eager's result",
              counters(g.a))
    except TypeError as e:
        check(False, f"R2 ({tag}): a call racing the retirement crashed: {e}", counters(g.a))
    finally:
        _PAUSE.clear()


class PausingDispatch(_wrap.Dispatch):
    @property
    def had_own(self):
        pause_here()
        return self.__dict__["had_own"]

    @had_own.setter
    def had_own(self, value):
        self.__dict__["had_own"] = value


def own_forward(module):
    def forward(x):
        return nn.Linear.forward(module, x) * 2

    module.forward = forward


def r3():
    _wrap.RETIRE_PIECES = True
    force_verdict(True)
    torch.manual_seed(0)
    ref = Root().to(DEV)
    g = copy.deepcopy(ref)
    own_forward(g.a), own_forward(ref.a)
    g = cg.graphify(g)
    ok = same(g, ref, calls=2)
    g.a.__dict__["forward"]._self_dispatch.__class__ = PausingDispatch
    seen = {}
    x2 = torch.randn(8, 64, device=DEV)

    def other():
        with torch.no_grad():
            seen["got"] = g.a(x2)

    _PAUSE.append(other)
    try:
        ok &= same(g, ref, calls=10)
    finally:
        _PAUSE.clear()
    check(ok, "R3: root calls through the retirement equal eager", counters(g.a))
    with torch.no_grad():
        want = ref.a(x2)
    check("got" in seen and torch.equal(seen["got"], want),
          "R3: a call inside _restore_forward runs the instance's own forward",
          "the class forward ran instead" if "got" in seen else "no call landed")


guarded("R2 change", lambda: r2(True))
guarded("R2 control", lambda: r2(False))
guarded("R3", r3)
