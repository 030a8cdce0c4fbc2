#!/usr/bin/env bash
# Hot recovery on NCCL, with figures, in under 5 minutes: kill -9 of one of 3 ranks (survivors' first step at world 2)
# and a warm join, on one machine with 2+ GPUs (NCCL refuses two ranks of one communicator on one GPU; with 2 GPUs
# the scenarios are 2 -> 1 and 1 -> 2).
#
# UNVERIFIED: the NCCL path (elasticd/worker/hot/backend.py, the hook's polling, the heal on the GPU) was written from
# torch 2.13's code and NCCL's documents on a machine without a GPU. This is the check to run the day one is lent.
#
# Usage: bench/gpu_check.sh [--backend nccl|gloo] [--trials N] [more options: bench/gpu_check.py --help]
# The venv (ELASTICD_VENV, default .venv) needs a CUDA build of torch 2.13 for nccl: `scripts/setup-venv test` pins
# torch==2.13.0, which is the CUDA wheel where pip reaches PyPI and no CPU wheel is on disk. `--backend gloo` runs the
# same scenarios on the CPU (how the driver was tested). Exit: 0 ok, 1 a trial failed, 2 this machine cannot run it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ELASTICD_VENV:-.venv}"
[ -x "$venv/bin/python" ] || { echo "gpu_check: no virtual environment at $venv (run scripts/setup-venv test)" >&2; exit 2; }
# The driver starts no trial it could not finish within 270 s; this is the backstop (it kills its workers on TERM).
exec timeout --kill-after=10 295 "$venv/bin/python" bench/gpu_check.py "$@"
