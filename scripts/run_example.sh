#!/usr/bin/env bash
# The main job. With a GPU: the tiny Qwen3-style MoE GPT trains on mock data with
# --moe-token-dispatcher-type ring and with alltoall, printing loss, tokens/s and peak memory.
# Without one: says so, plans the embedded Qwen3-30B-A3B default (`relaymoe plan`) and runs the
# CPU demo (scripts/cpu_demo.py): the Triton kernels and ring_moe against the float64 oracle,
# PASS/FAIL per check; the exit status is the demo's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -gt 0 ] && [ -f examples/tiny_qwen3/train.sh ]; then
  exec bash examples/tiny_qwen3/train.sh "$@"
fi
echo "No CUDA GPU here: the training example needs one (examples/tiny_qwen3/train.sh)."
echo "== relaymoe plan (Qwen3-30B-A3B on 32 H100s, the paper's setup): $PY -m relaymoe plan"
"$PY" -m relaymoe plan
echo "== CPU demo: Triton kernels (interpreter) and ring_moe (gloo, 2 processes) vs the oracle"
TRITON_INTERPRET=1 exec "$PY" scripts/cpu_demo.py
