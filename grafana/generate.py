"""Writes grafana/elasticd.json and grafana/alerts.yaml from grafana/dashboard.py and grafana/alerts.py.

python -m grafana.generate            # regenerate both files
python -m grafana.generate --check    # exit 1 if either file differs from what the code generates
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from grafana import alerts, dashboard

HERE = Path(__file__).resolve().parent
OUTPUTS: dict[str, Callable[[], str]] = {
    "elasticd.json": dashboard.render,
    "alerts.yaml": alerts.render,
}


def stale(directory: Path = HERE) -> list[str]:
    """Names of the generated files whose committed text differs from the generator's output."""
    return [
        name
        for name, render in OUTPUTS.items()
        if not (directory / name).exists() or (directory / name).read_text() != render()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale()
        for name in out_of_date:
            print(f"grafana/{name} is out of date: run python -m grafana.generate", file=sys.stderr)
        return 1 if out_of_date else 0
    for name, render in OUTPUTS.items():
        (HERE / name).write_text(render())
        print(f"wrote grafana/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
