"""The workers' environment from accelerate's config file, as ``accelerate launch`` would give it.

``accelerate config`` writes a user's answers (mixed precision, dynamo, CPU threads, GPU ids, ...) to a YAML file that
every ``accelerate launch`` reads: ``--config_file``, else accelerate's default location. :func:`worker_environment`
reads the same file with accelerate's own launch code: its argument parser, ``_validate_launch_command`` (the
defaults a launch fills in from the file) and ``prepare_simple_launcher_cmd_env`` (the variables a launch gives its
processes), and keeps what accelerate owns. elasticd's options win where both speak: the number of processes and
machines (``--nproc-per-node``, ``--min-nodes``/``--max-nodes``), the rendezvous and the master address (torch's agent
sets those each round). A setup elasticd cannot run (TPU, SageMaker, DeepSpeed, Megatron-LM, FSDP1) is a
:class:`~elasticd.errors.ConfigError`: one line, exit 2.

An FSDP config (``fsdp_version: 2``) gives the workers accelerate's FSDP variables as its multi-GPU launch would
(``ACCELERATE_USE_FSDP``, ``FSDP_*``); on a host without GPUs the worker library then makes accelerate take its FSDP2
path on gloo (:mod:`elasticd.worker.fsdp`). FSDP1 is refused: its checkpoints are not resharded by elasticd's loads.
A ``parallelism_config`` replicate size above 1 with FSDP is HSDP: the workers get ``ELASTICD_HYBRID_SHARD`` and each
node shards across its own workers, the nodes replicating (:mod:`elasticd.worker.hybrid`); each size the file fixes
is said at start.

Without a config file, the workers' CPU threads follow torchrun and accelerate: :func:`default_threads`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from elasticd import envvars
from elasticd import options as o
from elasticd.errors import ConfigError

KEY = o.ACCELERATE_CONFIG.flag
# What torch's agent sets for every worker, each round: never from accelerate's file.
_OWNED = frozenset({envvars.MASTER_ADDR, envvars.MASTER_PORT})
# accelerate's setups that elasticd cannot run: why, in a few words
_UNSUPPORTED = {
    "XLA": "TPU (XLA) training is launched by accelerate's TPU launcher",
    "DEEPSPEED": "DeepSpeed runs under its own launcher",
    "MEGATRON_LM": "Megatron-LM is not supported by elasticd's recovery",
}


@dataclass(frozen=True, slots=True)
class AccelerateEnv:
    """What the config file gives the workers."""

    path: Path | None  # the file read; None: there is none
    env: Mapping[str, str]  # variables to add to each worker's environment
    overridden: tuple[str, ...] = ()  # the file's settings elasticd's options replace, one line each


def worker_environment(path: Path | None, *, nproc_per_node: int, max_nodes: int, has_gpu: bool) -> AccelerateEnv:
    """The environment ``accelerate launch`` would give a worker, from ``path`` or accelerate's default file.

    Raises :class:`ConfigError` (``--accelerate-config``) for a missing explicit file, one accelerate refuses, or a
    setup elasticd cannot run."""
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    file = path if path is not None else Path(default_config_file)
    if not file.is_file():
        if path is not None:
            raise ConfigError(KEY, f"{path} does not exist or is not a file")
        return AccelerateEnv(None, {})
    try:
        config = load_config_from_file(str(file))
    except Exception as exc:  # YAML or JSON errors, unknown keys: accelerate's own message
        raise ConfigError(KEY, f"{file}: {_one_line(exc)}") from None
    kind = str(getattr(config.distributed_type, "value", config.distributed_type))
    _check_setup(file, str(getattr(config.compute_environment, "value", config.compute_environment)), kind)
    if kind == "FSDP":
        _check_fsdp(file, config.fsdp_config or {})

    total = nproc_per_node * max_nodes
    multi_device = kind.startswith("MULTI_") and kind != "MULTI_CPU"
    argv = [
        "--config_file",
        str(file),
        # accelerate refuses a multi-GPU launch of one process; under elasticd the count is --nproc-per-node's and
        # the nodes', and nothing taken from the file below depends on it
        "--num_processes",
        str(max(total, 2) if multi_device else total),
        "--num_machines",
        str(max_nodes),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        "29500",
        "elasticd-worker",
    ]
    try:
        with _quiet():  # accelerate's notes about the defaults it fills in are for its own launch
            args, _defaults, _from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
            _cmd, launched = prepare_simple_launcher_cmd_env(args)
            if kind == "FSDP":  # the simple launcher gives no FSDP variables; accelerate's multi-GPU launch does
                launched |= {k: v for k, v in prepare_multi_gpu_env(args).items() if _is_fsdp_variable(k)}
    except (ValueError, RuntimeError, AssertionError, SystemExit) as exc:
        raise ConfigError(KEY, f"{file}: {_one_line(exc)}") from None
    env = {k: v for k, v in launched.items() if os.environ.get(k) != v and k not in _OWNED}
    overridden = []
    if not has_gpu and env.get(envvars.ACCELERATE_USE_CPU, "").lower() in {"false", "0", "no"}:
        env[envvars.ACCELERATE_USE_CPU] = "true"  # accelerate would train each worker alone, on a host without GPUs
        overridden.append(f"{kind} (use_cpu false): this host has no GPU, the workers train on the CPU")
    if config.num_machines not in (1, max_nodes):
        overridden.append(f"num_machines {config.num_machines}: --min-nodes/--max-nodes decide (up to {max_nodes})")
    if config.num_processes not in (-1, None, total, nproc_per_node):
        overridden.append(
            f"num_processes {config.num_processes}: {nproc_per_node} per node (--nproc-per-node), {total} at most"
        )
    parallelism = getattr(config, "parallelism_config", None) or {}
    hybrid = kind == "FSDP" and str(parallelism.get("parallelism_config_dp_replicate_size", 1)) not in ("1", "None")
    if hybrid:
        env[envvars.HYBRID_SHARD] = "1"
    overridden += _parallelism_notes(parallelism, hybrid, nproc_per_node)
    return AccelerateEnv(file, env, tuple(overridden))


def _parallelism_notes(parallelism: Mapping[str, object], hybrid: bool, nproc_per_node: int) -> list[str]:
    """accelerate's ``parallelism_config`` sizes fix one world size, and an elastic run has many (accelerate's launch
    gives the workers none of them from the file either). Said at start, one line a size: under FSDP a replicate
    size above 1 asks for HSDP, which elasticd runs as each node's workers sharding and the nodes replicating, as
    many replicas as nodes in the round (``worker/hybrid.py``); otherwise the shard group is every worker."""
    notes = []
    for key, value in sorted(parallelism.items()):
        name = key.removeprefix("parallelism_config_")
        if not name.endswith("_size") or str(value) in ("1", "None"):
            continue
        if name == "dp_replicate_size" and hybrid:
            why = "HSDP with the nodes as replicas, as many as nodes in the round"
        elif name == "dp_shard_size" and hybrid:
            why = f"each node shards across its own workers ({nproc_per_node}, --nproc-per-node)"
        elif name == "dp_shard_size":
            why = "the model is sharded across every worker of the round, at whatever size it forms"
        else:
            why = f"{name.removesuffix('_size').upper()} parallelism is not supported by elasticd; ignored"
        notes.append(f"parallelism_config {name} {value}: {why}")
    return notes


def precheck(path: Path) -> None:
    """Before torch loads (a second into the start): an explicit file exists, parses and names a setup elasticd
    can run. accelerate's own reading follows in :func:`worker_environment`."""
    import yaml

    if not path.is_file():
        raise ConfigError(KEY, f"{path} does not exist or is not a file")
    try:
        data = yaml.safe_load(path.read_text())  # accelerate writes YAML or JSON, and JSON is YAML
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(KEY, f"{path}: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(KEY, f"{path}: expected accelerate's settings (a mapping), got {type(data).__name__}")
    kind = str(data.get("distributed_type", "NO"))
    _check_setup(path, str(data.get("compute_environment", "LOCAL_MACHINE")), kind)
    if kind == "FSDP":
        fsdp = data.get("fsdp_config") or {}
        _check_fsdp(path, fsdp if isinstance(fsdp, dict) else {})


def _check_setup(path: Path, environment: str, kind: str) -> None:
    if environment != "LOCAL_MACHINE":
        raise ConfigError(KEY, f"{path}: compute_environment {environment} cannot run under elasticd (LOCAL_MACHINE)")
    if kind in _UNSUPPORTED:
        raise ConfigError(KEY, f"{path}: distributed_type {kind}: {_UNSUPPORTED[kind]}; use accelerate launch")


def _check_fsdp(path: Path, fsdp: Mapping[str, object]) -> None:
    """FSDP2 (accelerate's default is 1) with a state dict that reshards: DCP's shards or one full copy."""
    version = str(fsdp.get("fsdp_version", 1))
    if version != "2":
        raise ConfigError(
            KEY, f"{path}: fsdp_version {version}: elasticd runs FSDP2 only; set fsdp_config.fsdp_version: 2"
        )
    kind = str(fsdp.get("fsdp_state_dict_type", "FULL_STATE_DICT")).upper()
    if kind == "LOCAL_STATE_DICT":
        raise ConfigError(
            KEY,
            f"{path}: fsdp_state_dict_type {kind}: its per-rank files load at one world size only, and elasticd"
            " resumes at any; use SHARDED_STATE_DICT (DCP, resharded on load)",
        )


def _is_fsdp_variable(name: str) -> bool:
    return name == envvars.ACCELERATE_USE_FSDP or name.startswith("FSDP_")


def default_threads(nproc_per_node: int, *, has_gpu: bool, cpu_cores: int | None) -> int | None:
    """``OMP_NUM_THREADS`` for each worker when neither the user nor accelerate's file set it (None: leave unset).

    On GPUs torchrun's rule: 1 when a node runs several workers (their CPU threads would oversubscribe the cores).
    On CPUs accelerate's: the physical cores shared among the node's workers, at least 1 (accelerate warns from
    every worker otherwise, and sets it itself)."""
    if has_gpu:
        return 1 if nproc_per_node > 1 else None
    return max(1, (cpu_cores or 1) // nproc_per_node)


def physical_cores() -> int | None:
    try:
        import psutil  # accelerate's dependency

        cores = psutil.cpu_count(logical=False)
        return int(cores) if cores else os.cpu_count()
    except ImportError:  # pragma: no cover - installed with accelerate
        return os.cpu_count()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    logger = logging.getLogger("accelerate.commands.launch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield None
    finally:
        logger.setLevel(level)
