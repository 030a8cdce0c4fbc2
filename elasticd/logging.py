"""structlog setup: JSON lines off a TTY, a readable console on one.

Every lifecycle event is one structlog event whose name is the ``event`` field (``rendezvous_done``,
``workers_started``, ...) and which carries ``run_id``, ``node_id`` and ``round`` (bound by the daemon).
docs/operations.md lists the events and their fields.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog


def configure_logging(
    fmt: Literal["json", "console"] | None = None, level: int = logging.INFO, *, stdlib: bool = True
) -> None:
    """Route structlog (and, with ``stdlib``, torch's stdlib loggers at WARNING) to stderr in ``fmt``.

    ``fmt`` None picks console on a TTY, JSON otherwise. Workers call it with ``stdlib=False``: the training
    script's own logging setup is not ours to change.
    """
    if fmt is None:
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if fmt == "json" else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # one write() per line: daemon and workers share stderr, and print() writes the newline separately
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    if not stdlib:
        return
    # torch.distributed.elastic logs every rendezvous step at INFO; our own events say what matters.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger("elasticd").bind(**bound)
