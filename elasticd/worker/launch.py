"""``python -u -m elasticd.worker.launch SCRIPT [ARGS]...``: how the daemon starts each worker, so that the worker
dies with its daemon (a daemon killed alone must not leave its workers training in a world they no longer belong to).

The launcher asks the kernel for SIGKILL when the daemon dies, checks that its parent is still the daemon named in
``ELASTICD_DAEMON_PID`` (if the daemon died before the request, nobody would ever send the signal), then replaces
itself with ``python -u SCRIPT ARGS``. The death signal survives ``execve``, the pid stays the one torch's agent
watches, and the script gets exactly the ``sys.argv``, ``__main__`` and unbuffered output of ``python -u SCRIPT``;
scripts that never import elasticd are covered too. The worker's own children are the reaper's
(``elasticd/agent/reaper.py``).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from elasticd import envvars
from elasticd.errors import EXIT_ORPHANED, EXIT_USAGE
from elasticd.parentdeath import parent_is, set_parent_death_signal

MODULE = "elasticd.worker.launch"
# The interpreter arguments before the script's: what agent/warm_start.py recognises as a worker's command line.
PREFIX = ("-u", "-m", MODULE)


def worker_args(script: str, script_args: Sequence[str]) -> tuple[str, ...]:
    """The interpreter arguments of a worker (torch's ``WorkerSpec.args`` with ``entrypoint=sys.executable``)."""
    return (*PREFIX, script, *script_args)


def main(argv: Sequence[str]) -> NoReturn:
    if not argv:
        sys.stderr.write(f"usage: python -m {MODULE} SCRIPT [ARGS]...\n")
        sys.exit(EXIT_USAGE)
    daemon_pid = int(os.environ.get(envvars.DAEMON_PID) or 0)
    if set_parent_death_signal(signal.SIGKILL) and daemon_pid and not parent_is(daemon_pid):
        sys.stderr.write(f"elasticd: daemon (pid {daemon_pid}) is gone; not starting {argv[0]}\n")
        sys.exit(EXIT_ORPHANED)
    os.execv(sys.executable, [sys.executable, "-u", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
