"""examples/train.py with a child process of its own, as DataLoader workers or a script's helper would be.

The child sleeps; its pid is printed as a JSON line ``{"event": "child", "pid": ..., "worker": ...}`` so a test can
check that it does not outlive the worker's daemon.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train.py"

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
print(json.dumps({"event": "child", "pid": child.pid, "worker": os.getpid()}), flush=True)
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
