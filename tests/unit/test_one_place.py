"""Each contract is written in one place: environment variable names in elasticd/envvars.py (and the prefix the
option table derives its names from), option flags in elasticd/options.py. Read from the package's source
(``tests/source_literals.py``): a string literal anywhere else that is one of them fails here (docstrings are prose
and are not read)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from elasticd import options
from tests.source_literals import literals, package_literals


def _offenders(allowed: set[str], wrong: Callable[[str], bool]) -> list[str]:
    return [str(lit) for lit in package_literals(outside="") if lit.path not in allowed and wrong(lit.text)]


def test_env_var_names_are_written_only_in_envvars_and_the_option_table() -> None:
    def is_env_name(text: str) -> bool:
        return text.startswith((options.ENV_PREFIX, "TORCH_"))

    assert _offenders({"envvars.py", "options.py"}, is_env_name) == []


def test_option_flags_are_written_only_in_the_option_table() -> None:
    flags = {option.flag for option in options.TABLE}
    assert _offenders({"options.py"}, flags.__contains__) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('X = "ELASTICD_FOO"\n', [(1, "ELASTICD_FOO")]),
        ('"""A docstring naming ELASTICD_FOO."""\nX = 1\n', []),
        ('def f(x):\n    return f"--min-nodes {x}"\n', [(2, "--min-nodes ")]),
    ],
)
def test_the_reader_sees_literals_and_f_string_parts_but_not_docstrings(
    source: str, expected: list[tuple[int, str]], tmp_path: Path
) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert [(lit.line, lit.text) for lit in literals(path)] == expected
