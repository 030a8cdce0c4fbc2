"""README.md shows the exact diff from examples/plain_train.py to examples/train.py (regenerate: run this file)."""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- diff:begin -->\n```diff\n)(.*?)(```\n<!-- diff:end -->)", re.S)


def render_diff() -> str:
    plain = (ROOT / "examples" / "plain_train.py").read_text().splitlines(keepends=True)
    elastic = (ROOT / "examples" / "train.py").read_text().splitlines(keepends=True)
    return "".join(difflib.unified_diff(plain, elastic, "examples/plain_train.py", "examples/train.py", n=1))


def test_readme_shows_the_current_diff_from_plain_accelerate_to_elasticd() -> None:
    match = BLOCK.search(README.read_text())
    assert match, "README.md lacks the <!-- diff:begin --> block"
    assert match.group(2) == render_diff(), "README diff is stale: run python tests/unit/test_readme.py"


if __name__ == "__main__":
    text = README.read_text()
    README.write_text(BLOCK.sub(lambda m: m.group(1) + render_diff() + m.group(3), text))
    sys.exit(0)
