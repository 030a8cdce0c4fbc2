"""elasticd: a fault-tolerant elastic training daemon for PyTorch, and the library its workers import.

Training scripts use ``elasticd.attach(accelerator)`` (see :mod:`elasticd.worker.run`); ``transformers.Trainer``
scripts use ``elasticd.Trainer`` instead (see :mod:`elasticd.worker.trainer.trainer`). The worker library is
imported lazily so that the command line (``elasticd status``) does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Run", "Trainer", "TrainingStopped", "__version__", "attach"]

if TYPE_CHECKING:
    from elasticd.worker.run import Run, TrainingStopped, attach
    from elasticd.worker.trainer.trainer import Trainer


def __getattr__(name: str) -> Any:
    if name in ("attach", "Run", "TrainingStopped"):
        from elasticd.worker import run

        return getattr(run, name)
    if name == "Trainer":  # imports transformers: only for the scripts that use it
        from elasticd.worker.trainer.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'elasticd' has no attribute {name!r}")
