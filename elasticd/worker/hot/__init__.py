"""Hot recovery, the worker's side: building blocks for keeping the processes and re-forming the group in place.

One job per module, wired together by the caller (the worker library, later; the tests today):

- ``failure.py``: :class:`StepHealth`, the shared verdict on the current step.
- ``comm_hook.py``: :class:`ResilientAllReduce`, the DDP hook that reduces on the current group with a bounded wait
  and turns any failure into a failed step instead of an exception in the training loop.
- ``step_guard.py``: :class:`FailedStepGuard`, which skips a failed step's optimizer and scheduler steps.
- ``reform.py``: :class:`Reformer`, a new default group in place and the prepared DDP model and accelerate state
  moved to it; :func:`start_private_world` (and on a GPU :func:`expect_world`) for a joiner.
- ``backend.py``: what differs per backend (:class:`GlooGroups`, :class:`NcclGroups` — NCCL unverified, no GPU
  here): how the old group is retired and the new one formed; :func:`worker_env` for the daemon.
- ``heal.py``: :func:`heal`, the source member's state copied to all members over the new group.
- ``registered.py``: the objects registered for checkpointing through a discarded step (:class:`Rollback`) and a
  heal, as a restart would load them.
- the private torch/accelerate names all this relies on are entries of ``elasticd/privates/``'s tables, checked
  when a :class:`Reformer` is built (their fallback: cold recovery).
- ``errors.py``: what makes the hot path give up (the caller then falls back to the cold path).

Typical wiring in one worker::

    health, holder = StepHealth(), GroupHolder()
    hook = ResilientAllReduce(holder, health); hook.register(model)
    guard = FailedStepGuard(health); guard.install(optimizer)
    reformer = Reformer(accelerator, model, holder)
    ...  # after optimizer.step(), scheduler.step(), zero_grad():
    if guard.take() is not None:  # the step failed: do not advance the data position
        reformer.reform(new_store, new_rank, new_world, plan_batches(global_batch, micro, new_world))
        state, report = heal(0, model, optimizer, scheduler, state)
"""

from elasticd.worker.hot.backend import AbandonedGroups, GlooGroups, Groups, NcclGroups, groups_for, worker_env
from elasticd.worker.hot.comm_hook import GroupHolder, ResilientAllReduce
from elasticd.worker.hot.errors import HealError, HotRecoveryError, ReformError, SurfaceChanged, UnsupportedSetup
from elasticd.worker.hot.failure import StepFailure, StepHealth
from elasticd.worker.hot.heal import HealReport, heal, order_by_progress
from elasticd.worker.hot.reform import Formation, Reformer, expect_world, start_private_world
from elasticd.worker.hot.step_guard import FailedStepGuard

__all__ = [
    "AbandonedGroups",
    "FailedStepGuard",
    "Formation",
    "GlooGroups",
    "GroupHolder",
    "Groups",
    "HealError",
    "HealReport",
    "HotRecoveryError",
    "NcclGroups",
    "ReformError",
    "Reformer",
    "ResilientAllReduce",
    "StepFailure",
    "StepHealth",
    "SurfaceChanged",
    "UnsupportedSetup",
    "expect_world",
    "groups_for",
    "heal",
    "order_by_progress",
    "start_private_world",
    "worker_env",
]
