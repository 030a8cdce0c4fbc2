"""elasticd: a fault-tolerant elastic training daemon for PyTorch, and the library its workers import.

Training scripts use ``elasticd.attach(accelerator)`` (see :mod:`elasticd.worker.run`). The worker library is
imported lazily so that the command line (``elasticd status``) does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Run", "TrainingStopped", "__version__", "attach"]

if TYPE_CHECKING:
    from elasticd.worker.run import Run, TrainingStopped, attach


def __getattr__(name: str) -> Any:
    if name in ("attach", "Run", "TrainingStopped"):
        from elasticd.worker import run

        return getattr(run, name)
    raise AttributeError(f"module 'elasticd' has no attribute {name!r}")
