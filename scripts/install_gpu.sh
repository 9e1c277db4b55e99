#!/usr/bin/env bash
# The GPU environment (.venv-gpu) for engine=sglang trainer=megatron transfer=mooncake: `make gpu-env`.
# slurm/gyre_122b.sbatch, slurm/gyre_2p4t.sbatch and scripts/gpu_check.sh run with its Python by default.
#
# It cannot share the default CPU venv: sglang 0.5.23 pins torch 2.14.1 (CUDA 13) and
# transformers 5.19.0, while the CPU install pins torch 2.13.0+cpu and transformers >= 5.20;
# the CUDA Mooncake build and mooncake-transfer-engine-non-cuda both install `mooncake`
# (shared/notes/cpu-stack.md §1, §4). So Gyre goes in with --no-deps, and everything else in one
# resolve from scripts/gpu_requirements.py: the stack's pins (sglang, its torch, megatron-core, the
# CUDA 13 Mooncake build) and Gyre's own dependencies from pyproject.toml (tensorboard, ...) less
# the two sglang pins differently. Python 3.11 means megatron-core 0.16.1 (0.17+ needs 3.12).
# About 11 GB and 5-7 minutes (sglang alone: 6.5 min measured on a CPU machine).
#
#   scripts/install_gpu.sh [python3.11]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-python3.11}"
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "want Python 3.11 (megatron-core 0.16.1; the project pins 3.11)" >&2; exit 2; }
VENV="$("$PYTHON" scripts/gpu_requirements.py --venv)"
REQS="$(mktemp /tmp/gyre-gpu-reqs.XXXXXX)"
trap 'rm -f "$REQS"' EXIT
"$PYTHON" scripts/gpu_requirements.py > "$REQS"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# One environment holds one `mooncake`: a CPU build or the CUDA 12 one from an earlier install goes.
"$VENV/bin/pip" uninstall --yes --quiet mooncake-transfer-engine mooncake-transfer-engine-non-cuda 2>/dev/null || true
"$VENV/bin/pip" install -r "$REQS"
"$VENV/bin/pip" install --no-deps -e .
"$VENV/bin/pip" check || echo "pip check reported conflicts above (expected only for gyre's own torch/transformers pins)" >&2
# torch first: it loads its CUDA 13 runtime (libcudart.so.13), which Mooncake's engine.so links.
"$VENV/bin/python" - <<'PY'
import torch
import mooncake.engine, megatron.core, sglang
from torch.utils.tensorboard import SummaryWriter  # logger=tensorboard, the default
print("gpu env:", "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "sglang", sglang.__version__, "megatron-core", megatron.core.__version__)
assert (torch.version.cuda or "").startswith("13."), f"torch {torch.__version__} is not a CUDA 13 build"
PY
