#!/usr/bin/env bash
# The tiny Qwen3-style MoE (configs/tiny_qwen3.yaml: 4 MoE layers, 8 experts top-2) trained on
# mock data on 1 or 2 GPUs with --moe-token-dispatcher-type ring and with alltoall, same seed:
# prints loss, tokens/s and peak memory of both and how far the loss curves are apart.
#   examples/tiny_qwen3/train.sh [STEPS]        (GPUS=1|2 to choose; default all visible, <= 2)
# Without a GPU it says so and shows the memory planner's view of the config instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
cd "$ROOT"
STEPS="${1:-${STEPS:-100}}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "No CUDA GPU on this machine: the tiny training example needs 1 or 2 GPUs."
  echo "Showing relaymoe's plan for the config instead:"
  exec "$PY" -m relaymoe plan --config tiny_qwen3 --gpu h100-80gb
fi
GPU_ARGS=()
[ -n "${GPUS:-}" ] && GPU_ARGS=(--gpus "$GPUS")
# the end-to-end harness (benchmarks/e2e.py): one torchrun job per dispatcher, then the comparison
exec "$PY" -m benchmarks.e2e --config tiny_qwen3 --steps "$STEPS" "${GPU_ARGS[@]}"
