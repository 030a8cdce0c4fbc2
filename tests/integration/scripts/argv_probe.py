"""Writes how it was started (argv, __name__, unbuffered output, sys.path[0]) as JSON to $PROBE_OUT, then sleeps."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    seen = {
        "argv": sys.argv,
        "name": __name__,
        "write_through": getattr(sys.stdout, "write_through", None),
        "path0": sys.path[0],
        "pid": os.getpid(),
    }
    with open(os.environ["PROBE_OUT"], "w") as out:
        json.dump(seen, out)
    time.sleep(float(os.environ.get("PROBE_SLEEP", "0")))
