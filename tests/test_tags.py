"""Thunder imports on this torch without leaving anything on torch.Tensor."""

from __future__ import annotations

import subprocess
import sys


def test_thunder_import_leaves_torch_tensor_unchanged():
    code = (
        "import torch\n"
        "before = set(dir(torch.Tensor))\n"
        "from cudagraphify import _tags\n"
        "th = _tags.thunder()\n"
        "assert th is not None, _tags._thunder_error\n"
        "import thunder.torch\n"
        "assert len(thunder.torch._torch_to_thunder_function_map) > 1000\n"
        "after = set(dir(torch.Tensor))\n"
        "assert after == before, sorted(after ^ before)\n"
        "print('ok', torch.__version__)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok")


def test_missing_thunder_is_reported_once_and_rules_still_work():
    code = (
        "import sys, warnings\n"
        "sys.modules['thunder'] = None  # as if it could not be imported\n"
        "import torch\n"
        "from cudagraphify import _tags\n"
        "from cudagraphify._policy import OpPolicy\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert _tags.thunder() is None and _tags.thunder() is None\n"
        "assert len(w) == 1 and 'own rules' in str(w[0].message)\n"
        "assert _tags.thunder_tags(torch.add, 'k', (torch.ones(1),), {}) == frozenset()\n"
        "tags = OpPolicy().tags(torch.nonzero, (torch.ones(2),), {}, accel=frozenset({'cpu'}))\n"
        "assert 'DYNAMIC_SHAPE' in tags\n"
        "assert _tags.tag_class().HOST_SYNC._value == 'HOST_SYNC'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
