"""The README's complete examples run as written (on the CPU here; on the current GPU where there is
one): each block marked ``<!-- runs in tests/test_readme.py -->`` is executed in a fresh namespace,
in a scratch directory."""

from __future__ import annotations

import re
import textwrap
import warnings
from pathlib import Path

import pytest

MARK = "<!-- runs in tests/test_readme.py -->"
README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[tuple[int, str]]:
    """(line, code) of each marked block."""
    text = README.read_text()
    out = []
    for m in re.finditer(r"^([ \t]*)" + re.escape(MARK) + r"\n\1```python\n(.*?)^\1```", text, re.S | re.M):
        out.append((text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group(2))))
    return out


def test_the_marked_examples_are_found():
    assert len(_blocks()) == README.read_text().count(MARK) >= 4


# The imports each example needs beyond torch and ramtorch.
NEEDS = {"peft": "peft", "torchao": "torchao", "transformers": "transformers", "Trainer": "accelerate"}


@pytest.mark.parametrize(("line", "code"), _blocks(), ids=[f"README.md:{n}" for n, _ in _blocks()])
def test_readme_example_runs(line: int, code: str, tmp_path, monkeypatch):
    for word, module in NEEDS.items():
        if word in code:
            pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # third-party deprecations are not the example's concern
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
