#!/usr/bin/env bash
# The main job. With a GPU: the tiny Qwen3-style MoE GPT trains on mock data with
# --moe-token-dispatcher-type ring and with alltoall, printing loss, tokens/s and peak memory.
# Without one: says so, plans the embedded Qwen3-30B-A3B default (`relaymoe plan`) and runs the
# CPU demo (scripts/cpu_demo.py): the Triton kernels and ring_moe against the float64 oracle,
# PASS/FAIL per check; the exit status is the demo's. Either way it ends with the next two
# commands to run (tokenise a corpus, dry-run the multi-node example; examples/qwen3/README.md).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
next_steps() {
  cat <<NEXT

Next (examples/qwen3/README.md walks through both):
  1. train on real text: DATA=real bash examples/tiny_qwen3/train.sh
     (makes a corpus, a tokenizer and the indexed dataset with 'relaymoe data'; trains ring and
     alltoall on it with a GPU, prints the training command without one)
  2. see the multi-node Qwen3-30B-A3B launch and what it needs, launching nothing:
     DRY_RUN=1 NNODES=4 GPUS_PER_NODE=8 MASTER_ADDR=10.0.0.1 bash examples/qwen3/train.sh qwen3_30b_a3b
     (MASTER_ADDR: node 0's address; required with more than one node)
NEXT
}
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -gt 0 ] && [ -f examples/tiny_qwen3/train.sh ]; then
  set +e
  bash examples/tiny_qwen3/train.sh "$@"
  rc=$?
  set -e
  [ "$rc" -eq 0 ] && next_steps
  exit "$rc"
fi
echo "No CUDA GPU here: the training example needs one (examples/tiny_qwen3/train.sh)."
echo "== relaymoe plan (Qwen3-30B-A3B on 32 H100s, the paper's setup): $PY -m relaymoe plan"
"$PY" -m relaymoe plan
echo "== CPU demo: Triton kernels (interpreter) and ring_moe (gloo, 2 processes) vs the oracle"
set +e
TRITON_INTERPRET=1 "$PY" scripts/cpu_demo.py
rc=$?
set -e
[ "$rc" -eq 0 ] && next_steps
exit "$rc"
