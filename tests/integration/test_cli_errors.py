"""User mistakes that need the machine to show: one line and exit 2 each.

A script the daemon cannot read, for root too.
Root reads any file whatever its mode (CAP_DAC_OVERRIDE): as root the CLI runs with that capability and
CAP_DAC_READ_SEARCH dropped from its bounding set (``setpriv``), so the file's mode applies as it would for a user.
A metrics port another process listens on.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_an_unreadable_script_is_named_in_one_line_with_exit_2(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    script.chmod(0)
    command = [sys.executable, "-m", "elasticd", "start", str(script)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv, "util-linux's setpriv is needed to drop root's file-access override"
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=50)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("elasticd: error:") and str(script) in line and "not readable" in line, line


def test_a_metrics_port_in_use_is_named_in_one_line_with_exit_2(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = [sys.executable, "-m", "elasticd", "start", "--metrics-port", str(port), "--etcd", "127.0.0.1:1"]
        done = subprocess.run([*command, str(script)], capture_output=True, text=True, timeout=50)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("elasticd: error: --metrics-port") and str(port) in line and "in use" in line, line
