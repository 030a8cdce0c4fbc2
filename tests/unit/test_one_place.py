"""Each contract is written in one place: environment variable names in elasticd/envvars.py (and the prefix the
option table derives its names from), option flags in elasticd/options.py, exit codes in elasticd/errors.py. Read
from the package's source (``tests/source_literals.py``, and ``ast`` for the exit codes): a string literal anywhere
else that is one of them, or an ``EXIT_*`` code defined anywhere else, fails here (docstrings are prose and are not
read)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elasticd import options
from tests.source_literals import PACKAGE, literals, package_literals

# How the names of the environment variables elasticd sets or reads begin: its own, torch's and torchrun's,
# accelerate's, OpenMP's, the collectives' (gloo, NCCL), CUDA's, Python's, gRPC's and etcd's.
ENV_PREFIXES = (
    options.ENV_PREFIX,
    "TORCH_",
    "TORCHELASTIC_",
    "MASTER_",
    "ACCELERATE_",
    "OMP_",
    "GLOO_",
    "NCCL_",
    "CUDA_",
    "PYTHON",
    "GRPC_",
    "ETCD_",
)
# torchrun's names for a worker's place in the job, which share no prefix.
TORCHRUN_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
    }
)


def _offenders(allowed: set[str], wrong: Callable[[str], bool]) -> list[str]:
    return [str(lit) for lit in package_literals(outside="") if lit.path not in allowed and wrong(lit.text)]


def is_env_name(text: str) -> bool:
    return text.startswith(ENV_PREFIXES) or text in TORCHRUN_NAMES


def test_env_var_names_are_written_only_in_envvars_and_the_option_table() -> None:
    assert _offenders({"envvars.py", "options.py"}, is_env_name) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ELASTICD_SOCKET", True),
        ("TORCHELASTIC_RESTART_COUNT", True),
        ("OMP_NUM_THREADS=", True),
        ("LOCAL_RANK", True),
        ("NCCL_SOCKET_IFNAME", True),
        ("LOCAL_MACHINE", False),  # an accelerate setting's value
        ("rank", False),
        (" set OMP_NUM_THREADS to choose", False),  # prose that names one, inside a message
    ],
)
def test_what_counts_as_an_env_name(text: str, expected: bool) -> None:
    assert is_env_name(text) is expected


def exit_codes(path: Path) -> Iterator[tuple[int, str]]:
    """(line, name) of each ``EXIT_*`` name bound to an int at module or class level in ``path``
    (``EXIT_ALLOWANCE_S = 30.0`` is a duration, not a code)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bodies = [tree.body, *(node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef))]
    for statement in (s for body in bodies for s in body):
        if isinstance(statement, ast.Assign):
            targets, value = statement.targets, statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets, value = [statement.target], statement.value
        else:
            continue
        if isinstance(value, ast.Constant) and type(value.value) is int:
            for target in targets:
                if isinstance(target, ast.Name) and target.id.startswith("EXIT_"):
                    yield statement.lineno, target.id


def test_exit_codes_are_defined_only_in_errors() -> None:
    elsewhere = [
        f"elasticd/{path.relative_to(PACKAGE)}:{line}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "errors.py"
        for line, name in exit_codes(path)
    ]
    assert elsewhere == []
    workers = {"EXIT_RESIZE", "EXIT_REJOIN", "EXIT_HOT_FALLBACK", "EXIT_ORPHANED"}
    assert workers <= {name for _, name in exit_codes(PACKAGE / "errors.py")}


def test_the_exit_code_reader_sees_int_constants_of_modules_and_classes_only(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "EXIT_A = 3\nEXIT_WAIT_S = 30.0\nclass C:\n    EXIT_B: int = 5\ndef f():\n    EXIT_C = 1\nEXITS = 2\n"
    )
    assert list(exit_codes(path)) == [(1, "EXIT_A"), (4, "EXIT_B")]


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
