"""``elasticd start`` answers the quick questions (metrics port, etcd, a node id in use) before it loads torch."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_daemon_does_not_load_torch() -> None:
    code = "import sys, elasticd.cli, elasticd.agent.daemon; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"
