"""examples/train.py with a large object registered for checkpointing (``test_checkpoint_handover.py``).

Every checkpoint then holds BALLAST_MB more, written by rank 0's background writer, so a write takes seconds on this
kind of machine and a recovery in place can happen, for real, while it is in flight. The object takes no part in
training: the job's arithmetic is examples/train.py's.

argv: BALLAST_MB, then examples/train.py's arguments
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train.py"


class Ballast:
    """State that accelerate saves with every checkpoint (``custom_checkpoint_0.pkl``) and loads back."""

    def __init__(self, mb: int) -> None:
        self.data = torch.ones(mb << 18)  # float32: 4 bytes each

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data = state["data"]


ballast_mb = int(sys.argv.pop(1))
prepare = Accelerator.prepare


def prepare_with_ballast(self: Accelerator, *args: Any, **kwargs: Any) -> Any:
    if not self._custom_objects:
        self.register_for_checkpointing(Ballast(ballast_mb))
    return prepare(self, *args, **kwargs)


Accelerator.prepare = prepare_with_ballast  # the example builds its own Accelerator: registered in its prepare()
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
