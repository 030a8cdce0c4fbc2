"""The integration harness reads a growing log incrementally and still sees exactly its JSON object lines."""

from __future__ import annotations

import os
from pathlib import Path

from tests.integration.cluster import read_json_lines


def test_a_growing_log_yields_each_object_line_once_and_a_last_line_once_complete(tmp_path: Path) -> None:
    log = tmp_path / "node.err"
    assert list(read_json_lines(log)) == []
    with log.open("ab") as f:
        f.write(b'{"a": 1}\nnot json\n{"b": 2}\n{"c"')
        f.flush()
        assert list(read_json_lines(log)) == [{"a": 1}, {"b": 2}]
        f.write(b": 3}")  # complete JSON, no newline yet: seen, as before the cache
        f.flush()
        assert list(read_json_lines(log)) == [{"a": 1}, {"b": 2}, {"c": 3}]
        f.write(b'\n[1]\n{"d": 4}\n')
        f.flush()
        assert list(read_json_lines(log)) == [{"a": 1}, {"b": 2}, {"c": 3}, {"d": 4}]


def test_a_log_truncated_or_replaced_is_read_again_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "node.out"
    log.write_text('{"a": 1}\n{"a": 2}\n')
    assert len(list(read_json_lines(log))) == 2
    log.write_text('{"x": 1}\n')
    assert list(read_json_lines(log)) == [{"x": 1}]
    other = tmp_path / "other"
    other.write_text('{"y": 1}\n{"y": 2}\n{"y": 3}\n')
    os.replace(other, log)
    assert list(read_json_lines(log)) == [{"y": 1}, {"y": 2}, {"y": 3}]
