#!/usr/bin/env bash
# The RelayMoE paper's Table 3 scaling configs (configs/table3/*.yaml): E64..E384, K4..K16, H512..H2048.
#   examples/qwen3/table3.sh            # every config in turn, ring then alltoall, 50 steps each
#   examples/qwen3/table3.sh k16 e384   # just these
# Uses the same environment as train.sh; these configs are 8-GPU runs (NNODES=1 by default).
set -euo pipefail
export NNODES="${NNODES:-1}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in "$ROOT"/configs/table3/*.yaml; do names+=("$(basename "$f" .yaml)"); done
fi
for n in "${names[@]}"; do
  for d in ring alltoall; do
    echo "=== table3/$n dispatcher=$d ==="
    DISPATCHER=$d TRAIN_ITERS="${TRAIN_ITERS:-50}" "$HERE/train.sh" "table3/$n" || echo "table3/$n $d failed"
  done
done
