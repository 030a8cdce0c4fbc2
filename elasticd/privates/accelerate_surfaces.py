"""Every private accelerate name elasticd uses, with what it is for, its check and its fallback (read with 1.15).

Three users: the asynchronous checkpoint saver (``worker/snapshot.py`` copies what ``save_state`` would save, from
the ``Accelerator``'s registries), the non-finite guard (``worker/guard.py`` and the hot path's step guard skip the
scheduler through the optimizer's overflow flag), and the hot path (``worker/hot/reform.py``: the process count in
accelerate's shared state). The daemon builds the workers' environment with accelerate's own launch code.
"""

from __future__ import annotations

from elasticd.privates.surface import Fallback, Process, Surface, callable_with, every, has, mentions, reads

_ACC = "accelerate.accelerator:Accelerator"
_STATE = "accelerate.state"
_OPTIMIZER = "accelerate.optimizer:AcceleratedOptimizer"
_SAVER = ("elasticd.worker.saver", "elasticd.worker.snapshot")


def _registry(attribute: str, use: str, users: tuple[str, ...] = _SAVER) -> Surface:
    """One of the Accelerator's registries that save_state saves from (read by save_state, so still an attribute)."""
    return Surface(
        f"accelerate.Accelerator.{attribute}",
        users,
        use,
        reads(f"{_ACC}.save_state", attribute),
        Fallback.BLOCKING_SAVES,
        Process.WORKER,
    )


def _shared_state(cls: str) -> Surface:
    owner = f"{_STATE}:{cls}"
    return Surface(
        f"accelerate.state.{cls}._shared_state",
        ("elasticd.worker.hot.reform",),
        f"num_processes and process_index of the new group ({cls}'s copy)",
        # instances are views of the class-level dict: num_processes and process_index live in it
        every(has(owner, "_shared_state"), mentions(f"{owner}.__init__", "self.__dict__ = self._shared_state")),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
    )


ACCELERATE: tuple[Surface, ...] = (
    _registry("_models", "the prepared models whose state an asynchronous save copies, and its pre-hooks' argument"),
    _registry("_optimizers", "the prepared optimizers an asynchronous save copies"),
    _registry("_schedulers", "the prepared schedulers an asynchronous save copies"),
    _registry("_dataloaders", "the prepared loaders whose position an asynchronous save copies"),
    _registry(
        "_custom_objects",
        "objects registered with register_for_checkpointing, copied by an asynchronous save (and by the hot path)",
        (*_SAVER, "elasticd.worker.hot.registered"),
    ),
    _registry("_save_model_state_pre_hook", "the hooks save_state runs before saving, run by an asynchronous save"),
    Surface(
        "accelerate.optimizer.AcceleratedOptimizer._is_overflow",
        ("elasticd.worker.guard", "elasticd.worker.hot.step_guard"),
        "a skipped optimizer step (non-finite, or a failed step) skips the scheduler's too",
        every(
            reads(f"{_OPTIMIZER}.__init__", "_is_overflow"),
            reads(f"{_OPTIMIZER}.step_was_skipped.fget", "_is_overflow"),
            reads("accelerate.scheduler:AcceleratedScheduler.step", "step_was_skipped"),
        ),
        Fallback.REFUSE_TO_START,
        Process.WORKER,
    ),
    Surface(
        # what the hot path relies on is public behaviour read through the registry above: a moved registry or a
        # changed load_custom_state turns recovery in place off (the objects would silently miss a rollback)
        "accelerate.Accelerator.register_for_checkpointing",
        ("elasticd.worker.hot.registered",),
        "the registered objects rolled back after a discarded step and healed to every member (worker/hot/"
        "registered.py), loaded as load_custom_state loads them: on the CPU, into load_state_dict",
        every(
            reads(f"{_ACC}.__init__", "_custom_objects"),
            mentions(f"{_ACC}.register_for_checkpointing", "self._custom_objects.extend("),
            mentions("accelerate.checkpointing:load_custom_state", 'map_location="cpu"', "obj.load_state_dict("),
        ),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
    ),
    _shared_state("PartialState"),
    _shared_state("AcceleratorState"),
    Surface(
        "accelerate.Accelerator.step",
        ("elasticd.worker.hot.reform",),
        "the micro-batch counter that decides when to sync (read by _do_sync), restarted at a new world size",
        mentions(f"{_ACC}._do_sync", "self.step"),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
    ),
    Surface(
        "accelerate.state.PartialState.use_distributed",
        ("elasticd.worker.hot.reform",),
        "a GPU joiner's world of one shows more processes so that prepare() wraps DDP (expect_world)",
        mentions(f"{_STATE}:PartialState.use_distributed.fget", "self.num_processes > 1"),
        Fallback.COLD_RECOVERY,
        Process.WORKER,
        backend="nccl",
    ),
    Surface(
        "accelerate.commands.launch._validate_launch_command",
        ("elasticd.accelerate_env",),
        "accelerate's own checks and defaults of a launch, so the workers get what accelerate launch would give",
        callable_with("accelerate.commands.launch:_validate_launch_command", "args"),
        Fallback.REFUSE_TO_START,
        Process.DAEMON,
    ),
)
