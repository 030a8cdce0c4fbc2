"""The YAML ``--config`` file: a flat mapping of option names to values, checked before anything else runs.

Keys are the long option names with or without the leading ``--`` and with ``-`` or ``_`` (``min-nodes``,
``min_nodes``); an unknown key is rejected with the closest accepted name. Values are converted by the option's own
type so a bad value is reported with the file and key it came from.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from elasticd import options as o
from elasticd.errors import ConfigError


def normalise_key(key: str) -> str:
    return key.strip().lstrip("-").replace("_", "-")


def load_config_file(path: Path, converters: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """Read ``path`` and return ``{option-name: converted value}``.

    ``converters`` maps each accepted option name (dashed, no ``--``) to a function that converts a raw YAML value
    or raises ``ValueError`` with a message.
    """
    label = f"{o.CONFIG.flag} {path}"
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(o.CONFIG.flag, f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(label, f"not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(label, f"expected a mapping of option names to values, got {type(data).__name__}")

    resolved: dict[str, Any] = {}
    for raw_key, raw_value in data.items():
        key = normalise_key(str(raw_key))
        if key not in converters:
            close = difflib.get_close_matches(key, converters, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; accepted: {', '.join(sorted(converters))}"
            raise ConfigError(f"{label}: {raw_key}", f"unknown key{hint}")
        try:
            resolved[key] = converters[key](raw_value)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{label}: {raw_key}", str(exc) or "invalid value") from None
    return resolved
