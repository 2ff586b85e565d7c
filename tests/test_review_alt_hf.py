"""Review of 67e0e31 (the replay path kept aside), HF part: ``generate()`` after ``generate()``
with prompts of two lengths, a StaticCache's graphs or a DynamicCache's pieces, on the CPU
double, compared with eager's (see tests/test_review_alt.py for the rest)."""

from __future__ import annotations

import pytest
import torch

import cudagraphify as cg
from test_other_fast import slow_calls  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")
from test_review_hfcache import _GEN, _pair as _hf_pair, _same_generate  # noqa: E402
from test_review_hfcache import device_counter  # noqa: E402,F401 (a fixture)


@pytest.mark.parametrize("static", [True, False])
def test_control_hf_generates_prefill_and_decode_in_turn(
        sim, device_counter, slow_calls, static):  # noqa: F811 (fixtures)
    """generate() after generate(): a StaticCache's graphs (whole model), or a DynamicCache's
    pieces (a plan around the opaque cache); prompts of one length and of another."""
    ref, g, _ = _hf_pair()
    kw = dict(cache_implementation="static") if static else {}
    torch.manual_seed(5)
    with torch.no_grad():
        for n in range(6):
            ids = torch.randint(1, 64, (1, 4 if n % 3 else 6))
            want = ref.generate(ids, disable_compile=True, **kw, **_GEN)
            got = g.generate(ids, **kw, **_GEN)
            assert _same_generate(got, want), n
    s = cg.stats(g)
    assert s.replays > 0 or any(cg.stats(p).replays for p in g.modules()
                                if getattr(p, "_cudagraphify_state", None) is not None)
