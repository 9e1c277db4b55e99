#!/usr/bin/env bash
# The prepared GPU check (one H100 or H200, <= 8 minutes): SGLang serving with log-probs, a Megatron
# GSPO step, the core's stop -> weights -> checkpoint -> start -> step cycle timed against the
# heartbeat and start limits, GPU 0's peak with the Mooncake publisher's slots, one-trajectory steps
# up to 32k tokens, the weight update into SGLang, a role switch each way, the CUDA 13 Mooncake pull.
# Needs the GPU environment (make gpu-env: .venv-gpu); its last stdout line is one JSON object,
# also when the driver dies or runs out of time.
#
#   scripts/gpu_check.sh [gpu_check.py options]      GYRE_GPU_PYTHON=path/to/python to override
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${GYRE_GPU_PYTHON:-.venv-gpu/bin/python}"
LIMIT_S="${GYRE_GPU_CHECK_LIMIT_S:-470}"   # hard stop; the driver budgets 450 s for its stages
OUT="$(mktemp /tmp/gyre-gpu-check.XXXXXX)"

fail() {  # the contract: the last line is JSON even when nothing ran
  printf '{"ok": false, "errors": {"gpu_check.sh": "%s"}}\n' "$1"
  exit 1
}
[ -x "$PY" ] || fail "no python at $PY: run scripts/install_gpu.sh or set GYRE_GPU_PYTHON"
command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: not a GPU machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
# What the stages asked for need: --no-sglang and --skip-mooncake leave those packages out.
need=(megatron.core torch)
[[ " $* " == *" --no-sglang "* ]] || need+=(sglang)
[[ " $* " == *" --skip-mooncake "* ]] || need+=(mooncake.engine)
mods="$(IFS=,; echo "${need[*]}")"
"$PY" -c "import $mods; import torch; assert torch.cuda.is_available()" >&2 \
  || fail "the GPU environment is incomplete (${need[*]}, CUDA torch)"

# On the limit the driver gets SIGTERM: it stops the SGLang server it started and still prints
# its JSON; 20 s later it is killed outright.
timeout --kill-after=20 "$LIMIT_S" "$PY" scripts/gpu_check.py "$@" >"$OUT"
rc=$?
last="$(tail -n 1 "$OUT")"
if [[ "$last" == \{* ]]; then
  echo "$last"
else
  fail "driver exited with $rc before printing its JSON (124 = over ${LIMIT_S}s)"
fi
