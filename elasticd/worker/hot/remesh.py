"""An FSDP2 model and its optimizer moved, in place, onto a device mesh of another size.

torch has no call for this: ``fully_shard`` binds each parameter group to its mesh for the module's life. What
:func:`remesh` does instead, per FSDP state, is what ``fully_shard`` itself does at wrap time (read in torch 2.13's
``_fully_shard/_fully_shard.py`` and ``_fsdp_init.py``): put plain parameters back on the modules and build the
state's parameter groups anew over the new mesh with the old groups' policies (``_init_param_group``), then reset
the states' lazy initialisation so the next forward redoes it (root, FQNs, shared communication context). The
modules, their hooks and the user's references to the model stay the same objects.

The new parameter of a group is full-sized but only this rank's new rows are written (``torch.empty`` touches no
other page): ``FSDPParam`` copies exactly those rows into its shard. The optimizer keeps its object, param groups and
hyperparameters; its parameters are swapped for the new sharded ones and its per-parameter state (AdamW's moments:
DTensors sharded like their parameter) is rebuilt from the new local rows. What is not sharded (a step count) is
kept as it is, which is right because every rank holds the same.

A bit-exact check against a fresh model of the new size loaded from the same state:
``tests/integration/test_shard_reshard.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from elasticd.worker.hot.errors import UnsupportedSetup

try:  # private: elasticd/privates/torch_surfaces.py (_SHARDED_IN_PLACE)
    from torch.distributed.fsdp._fully_shard._fsdp_init import _init_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPStateContext, _get_module_fsdp_state
    from torch.distributed.fsdp._fully_shard._fully_shard import _get_mesh_info, _get_post_forward_mesh_info
except ImportError:  # pragma: no cover - a torch that moved them: the hot path is not armed for sharded jobs
    _init_param_group = None  # type: ignore[assignment]

# The per-group settings FSDPModule's setters change after wrapping (accelerate's and users' calls) that a rebuilt
# group must keep.
_GROUP_SETTINGS = (
    "reduce_grads",
    "all_reduce_grads",
    "reshard_after_backward",
    "gradient_divide_factor",
    "unshard_in_backward",
    "reduce_scatter_unused_params",
    "force_sum_reduction_for_comms",
)


def param_key(fqn: str) -> str:
    return f"p:{fqn}"


def optim_key(fqn: str, name: str) -> str:
    return f"o:{fqn}:{name}"


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Every dim-0-sharded tensor of a job (parameters and their optimizer state), by key: its global shape and
    dtype. The same on every rank of any world size (a joiner computes it from its own model)."""

    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, torch.dtype]

    def rows(self) -> dict[str, int]:
        return {k: s[0] if s else 1 for k, s in self.shapes.items()}

    def row_bytes(self) -> dict[str, int]:
        out = {}
        for k, shape in self.shapes.items():
            per_row = 1
            for d in shape[1:]:
                per_row *= d
            out[k] = per_row * self.dtypes[k].itemsize
        return out


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's


def sharded_tensors(model: nn.Module, optimizer: Any) -> dict[str, DTensor]:
    """This rank's sharded tensors by key: every parameter, and every DTensor of the optimizer's state."""
    out: dict[str, DTensor] = {}
    names: dict[int, str] = {}
    for fqn, p in model.named_parameters():
        if not isinstance(p, DTensor) or p.placements != (Shard(0),):
            raise UnsupportedSetup(f"parameter {fqn}", "in place, FSDP2 on a 1-D mesh only (no HSDP, no TP)")
        out[param_key(fqn)] = p
        names[id(p)] = fqn
    for owner, state in _inner(optimizer).state.items():
        for name, value in state.items():
            if isinstance(value, DTensor):
                out[optim_key(names[id(owner)], name)] = value
    return out


def layout_of(tensors: Mapping[str, DTensor]) -> ShardLayout:
    return ShardLayout({k: tuple(t.shape) for k, t in tensors.items()}, {k: t.dtype for k, t in tensors.items()})


def _fsdp_states(model: nn.Module) -> list[Any]:
    states: list[Any] = []
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        if state is not None and all(state is not s for s in states):
            states.append(state)
    return states


def remesh(
    model: nn.Module,
    optimizer: Any,
    mesh: DeviceMesh,
    local: Mapping[str, torch.Tensor],
    layout: ShardLayout,
    replicated: Mapping[str, Mapping[str, Any]],
) -> None:
    """Move ``model`` (FSDP2) and ``optimizer`` onto ``mesh``. ``local`` holds this rank's new rows of every key of
    ``layout`` (:func:`sharded_tensors` of the group; ``shard_rows`` of the new world), which become its shards;
    ``replicated``: the optimizer's unsharded state (:func:`replicated_state`)."""
    if _init_param_group is None:  # pragma: no cover
        raise UnsupportedSetup("this torch", "FSDP2's parameter-group construction (_init_param_group) moved")
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    mesh_info = _get_mesh_info(mesh, None)
    swapped: dict[int, tuple[nn.Parameter, str]] = {}  # id(old sharded param) -> (new sharded param, fqn)
    states = _fsdp_states(model)
    for state in states:
        old_groups = list(state._fsdp_param_groups)
        state._fsdp_param_groups.clear()
        for group in old_groups:
            olds, news = [], []
            for fsdp_param in group.fsdp_params:
                old = fsdp_param.sharded_param
                fqn = fqn_of[id(old)]
                rows = local[param_key(fqn)]
                full = torch.empty(tuple(old.shape), dtype=old.dtype, device=rows.device)
                start = _row_start(old.shape[0], mesh)
                full[start : start + rows.shape[0]].copy_(rows)
                plain = nn.Parameter(full, requires_grad=old.requires_grad)
                info = fsdp_param._module_info
                setattr(info.module, info.param_name, plain)
                for module, name in zip(info.shared_modules, info.shared_param_names, strict=True):
                    setattr(module, name, plain)
                olds.append((old, fqn))
                news.append(plain)
                # its load post-hook would re-pad a loaded shard to the old world's size (a reload in place)
                fsdp_param._post_load_hook_handle.remove()
            for handle in (
                *group._module_to_pre_save_state_dict_hook_handle.values(),
                *group._module_to_pre_load_state_dict_hook_handle.values(),
            ):
                handle.remove()
            post = None if group.post_forward_mesh_info is None else _get_post_forward_mesh_info(True, mesh_info)  # type: ignore[arg-type]
            _init_param_group(
                state, news, group.modules, mesh_info, post, group.device, None, group.mp_policy, group.offload_policy
            )
            rebuilt = state._fsdp_param_groups[-1]
            for setting in _GROUP_SETTINGS:
                if hasattr(group, setting):
                    setattr(rebuilt, setting, getattr(group, setting))
            for (old, fqn), fsdp_param in zip(olds, rebuilt.fsdp_params, strict=True):
                swapped[id(old)] = (fsdp_param.sharded_param, fqn)
    for state in states:  # the next forward redoes the lazy initialisation over the new groups
        state._is_root = None
        state._state_ctx = FSDPStateContext()
    _swap_optimizer(_inner(optimizer), swapped, mesh, local, layout, replicated)


def _row_start(n: int, mesh: DeviceMesh) -> int:
    per = -(-n // mesh.size()) if n else 0
    return min(n, per * mesh.get_local_rank())


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def replicated_state(model: nn.Module, optimizer: Any) -> dict[str, dict[str, Any]]:
    """The optimizer's per-parameter state that is not sharded (AdamW's step count), by parameter FQN: the same on
    every rank; a joiner gets it from a member."""
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    return {
        fqn_of[id(p)]: {
            k: v.clone() if isinstance(v, torch.Tensor) else v  # AdamW counts its steps in place
            for k, v in state.items()
            if not isinstance(v, DTensor)
        }
        for p, state in _inner(optimizer).state.items()
    }


def _swap_optimizer(
    optimizer: torch.optim.Optimizer,
    swapped: Mapping[int, tuple[nn.Parameter, str]],
    mesh: DeviceMesh,
    local: Mapping[str, torch.Tensor],
    layout: ShardLayout,
    replicated: Mapping[str, Mapping[str, Any]],
) -> None:
    for group in optimizer.param_groups:
        group["params"] = [swapped[id(p)][0] for p in group["params"]]
    sharded: dict[str, dict[str, torch.Tensor]] = {}
    for key, rows in local.items():
        if key.startswith("o:"):
            fqn, name = key[2:].rsplit(":", 1)
            shape = layout.shapes[key]
            sharded.setdefault(fqn, {})[name] = DTensor.from_local(
                rows, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape)
            )
    rebuilt: dict[Any, dict[str, Any]] = {}
    for new, fqn in swapped.values():
        entry = {**replicated.get(fqn, {}), **sharded.get(fqn, {})}
        if entry:
            rebuilt[new] = entry
    optimizer.state.clear()
    optimizer.state.update(rebuilt)
