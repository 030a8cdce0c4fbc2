"""What the recovery and goodput benchmarks' jobs train (bench/recovery.py, bench/goodput.py): examples/train.py's
arguments, its model's size and the state a change in place broadcasts from rank 0 (the full model, optimizer and
scheduler state), so a caption can say exactly what was measured."""

from __future__ import annotations

from dataclasses import dataclass

SCRIPT_NAME = "train.py"  # examples/train.py, run by every system


def mlp_parameters(width: int, depth: int, features: int = 16) -> int:
    """Parameters of examples/train.py's model at ``--width`` and ``--depth`` (``features`` inputs, one output)."""
    return (features + 1) * width + (depth - 1) * (width + 1) * width + width + 1


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    script_args: tuple[str, ...]
    parameters: int
    steady_steps: int  # steps at the expected size before a measurement
    # every wait of bench/recovery.py (steady state, recovery) gets this many times its timeout: slow steps
    timeout_scale: float = 1.0
    # what every node's environment adds (the sharded job: accelerate's FSDP2 variables, as its config gives them)
    env: tuple[tuple[str, str], ...] = ()
    script: str = SCRIPT_NAME  # the file under examples/ every system runs

    @property
    def state_bytes(self) -> int:
        # fp32 weights and AdamW's two fp32 moments (the scheduler's and the step counters' bytes are noise)
        return 3 * 4 * self.parameters


# The 7 kB job every target is set on: 50 ms of stand-in compute per step (each ~0.06-0.1 s here); 1000 epochs of
# 100 steps are never reached: every trial ends in a kill.
SMALL = Workload("small", ("--sleep", "0.05", "--epochs", "1000"), mlp_parameters(32, 1), steady_steps=10)
# ~1.2 GB of state: the smallest global batch both world sizes (2 and 3) divide keeps its ~100M-parameter steps to
# seconds on 2 cores shared by 3 workers (the work is reading the weights, the all-reduce and AdamW), a small
# learning rate keeps its loss finite, and fewer steady steps keep a trial to minutes. A join waits for the joiner
# to build its model and for the group's next step boundary, and then for the 1.2 GB broadcast: 69 s at 1.5 busy
# cores of other work, beyond 120 s at 1.8.
_LARGE_MODEL = ("--width", "4096", "--depth", "7", "--lr", "1e-4")
LARGE = Workload(
    "large",
    (*_LARGE_MODEL, "--global-batch", "6", "--micro-batch", "1", "--epochs", "1000"),
    mlp_parameters(4096, 7),
    steady_steps=4,
    timeout_scale=2.5,
)
# The sharded job (bench/recovery.py --sharded): examples/train.py's MLP at 4 layers of 1024 units (~3.2M parameters,
# ~38 MB of weights and AdamW moments) sharded by accelerate's FSDP2 path, each Linear its own shard unit, with DCP
# checkpoints. The same variables reach every system's workers: elasticd's and torchrun's.
FSDP2_ENV = (
    ("ACCELERATE_USE_FSDP", "true"),
    ("FSDP_VERSION", "2"),
    ("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"),
    ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"),
    ("FSDP_MIN_NUM_PARAMS", "100000"),
)
SHARDED = Workload(
    "sharded",
    ("--width", "1024", "--depth", "4", "--sleep", "0.05", "--epochs", "1000"),
    mlp_parameters(1024, 4),
    steady_steps=10,
    env=FSDP2_ENV,
)
# The sharded job at ~100M parameters (bench/recovery.py --sharded, its large scenarios): LARGE's model, batch, steady
# steps and timeouts, sharded by the same FSDP2 path (each 4096 x 4096 Linear its own shard unit), DCP checkpoints.
SHARDED_LARGE = Workload(
    "sharded_large",
    LARGE.script_args,
    LARGE.parameters,
    steady_steps=LARGE.steady_steps,
    timeout_scale=LARGE.timeout_scale,
    env=FSDP2_ENV,
)
# bench/recovery.py --job plain: the 7 kB job's model and pace as an unchanged accelerate script trains it
# (examples/plain_train.py: no worker library, so elasticd recovers it cold; its own save_state every 10 steps)
PLAIN = Workload(
    "plain",
    ("--sleep", "0.05", "--epochs", "1000", "--checkpoint-every", "10"),
    mlp_parameters(32, 1),
    steady_steps=10,
    script="plain_train.py",
)
# bench/recovery.py --job trainer: a Hugging Face Trainer script (examples/trainer_text_classification.py: the tiny
# BERT-style classifier of examples/text_classification.py, 75,458 parameters, global batch 48, elasticd.Trainer's
# lineage commits every 10 steps); elasticd recovers it cold.
TRAINER = Workload(
    "trainer",
    ("--sleep", "0.05", "--epochs", "1000", "--save-steps", "10"),
    75_458,
    steady_steps=10,
    timeout_scale=1.5,
    script="trainer_text_classification.py",
)
