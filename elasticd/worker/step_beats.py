"""The step beats a worker sends its daemon, batched: a short step pays for a beat only every :data:`BEAT_INTERVAL_S`.

The samples, training time and own time of the steps between two beats add up in the next one, so a 20 ms step pays
for a beat (~0.1 ms) and a ``loss.item()`` (a device sync on a GPU) only every dozen steps; a step with a guard
verdict other than OK is reported at once.
"""

from __future__ import annotations

from typing import Any

import torch

from elasticd.messages import Kind
from elasticd.worker.beats import BeatClient

# Seconds between two step beats (see the module docstring).
BEAT_INTERVAL_S = 0.25


class StepBeats:
    """What the steps since the last beat add up to, and the beat that reports them."""

    def __init__(self, beats: BeatClient) -> None:
        self.beats = beats
        self._last_beat_s = -BEAT_INTERVAL_S
        self._samples = 0
        self._train_s = 0.0
        self._own_s = 0.0
        self._steps = 0

    def completed(
        self, step: int, *, now: float, samples: int, step_time_s: float, own_s: float, loss: Any, urgent: bool
    ) -> None:
        """Step ``step`` ended at ``now`` (perf_counter seconds): beat when the interval passed or ``urgent``."""
        self._samples += samples
        self._train_s += step_time_s
        self._own_s += own_s
        self._steps += 1
        if now - self._last_beat_s < BEAT_INTERVAL_S and not urgent:
            return
        self._last_beat_s = now
        self.beats.send(
            Kind.STEP,
            step=step,
            loss=loss_value(loss),
            samples=self._samples,
            step_time_s=step_time_s,
            train_s=self._train_s,
            own_s=self._own_s / self._steps,
            phase="train",
        )
        self._samples, self._train_s, self._own_s, self._steps = 0, 0.0, 0.0, 0


def loss_value(loss: Any) -> float | None:
    """The loss the script passed to ``run.step`` as a float (a tensor's ``.item()``), None when it is no number."""
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().float().item())
    return float(loss) if isinstance(loss, int | float) else None
