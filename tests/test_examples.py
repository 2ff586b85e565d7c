"""The examples run as written (on a CPU they run eagerly and say so)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

HELPERS = {"gpt.py"}  # modules the examples import, not examples
EXAMPLES = sorted(p for p in (pathlib.Path(__file__).parent.parent / "examples").glob("*.py")
                  if p.name not in HELPERS)
NEEDS = {"llama_decode.py": "transformers", "hf_generate.py": "transformers"}  # examples that need a package the tests do not


def test_examples_use_only_the_public_api():
    """An example imports cudagraphify itself, never a private module or the benchmark."""
    for path in EXAMPLES + [EXAMPLES[0].parent / h for h in HELPERS]:
        text = path.read_text()
        assert "from cudagraphify." not in text and "import cudagraphify." not in text, path.name
        assert "cg._" not in text and "cudagraphify._" not in text, path.name


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    needed = NEEDS.get(path.name)
    if needed and importlib.util.find_spec(needed) is None:
        pytest.skip(f"{path.name} needs {needed} (pip install {needed})")
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "equal eager" in r.stdout
