"""FSDP on CPU, for CI and small clusters: accelerate's own FSDP2 path over gloo.

accelerate 1.15 turns ``ACCELERATE_USE_FSDP`` into ``DistributedType.FSDP`` only for GPU-class devices (``state.py``,
the ``distributed_type`` switch of ``AcceleratorState``); on a CPU host it silently trains the model replicated, under
DDP. Yet torch's ``fully_shard`` and DCP run on CPU tensors over gloo, and so does every line of accelerate's FSDP2
code (``fsdp2_prepare_model``, ``save_fsdp_model``/``load_fsdp_model`` through DCP). :func:`take_fsdp_path` makes
accelerate take that path on a CPU host: the same code a GPU job runs, only the collectives' backend differs.

It must run after ``Accelerator()`` and before ``prepare``. The type is set on both of accelerate's shared states:
``AcceleratorState()`` (built again by accelerate's optimizer wrapper, for one) copies ``PartialState``'s attributes
over its own each time it is constructed, so a type set on one alone is undone at the next ``prepare``. Both name
FSDP as a torch-distributed type wherever accelerate asks (barriers, gathers).
"""

from __future__ import annotations

import os
from typing import Any

from elasticd import envvars

# What a CPU job that asked for FSDP trains with, as the start event says.
CPU_PATH = "FSDP on CPU, for CI and small clusters: accelerate's FSDP2 path (fully_shard, DCP) over gloo"


def asked_for_fsdp() -> bool:
    """Did accelerate's config (or the user's environment) ask for FSDP?"""
    return os.environ.get(envvars.ACCELERATE_USE_FSDP, "false").lower() == "true"


def fsdp_version() -> int:
    try:
        return int(os.environ.get(envvars.FSDP_VERSION, "1"))
    except ValueError:
        return 1


def is_fsdp(accelerator: Any) -> bool:
    """Does ``accelerator`` shard its models (any FSDP version)?"""
    from accelerate.utils import DistributedType

    return bool(accelerator.distributed_type == DistributedType.FSDP)


def take_fsdp_path(accelerator: Any, log: Any = None) -> bool:
    """On a CPU host whose job asked for FSDP2, make ``accelerator`` shard with accelerate's FSDP2 code (rank 0 says
    so on ``log``); True when it did. A GPU host needs nothing (accelerate chose FSDP itself); FSDP1 is left as
    accelerate chose."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not asked_for_fsdp() or fsdp_version() != 2 or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    if accelerator._models:  # prepare() already wrapped a model in DDP: too late to shard it
        raise RuntimeError("elasticd.attach(accelerator) must come before accelerator.prepare() under FSDP")
    state = AcceleratorState()
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables, as Accelerator() built its own
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)  # as AcceleratorState does on GPUs
    PartialState().distributed_type = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if log is not None and accelerator.is_main_process:
        log.info("fsdp_on_cpu", message=CPU_PATH, mixed_precision=state.mixed_precision)
    return True
