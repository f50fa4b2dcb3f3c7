#!/usr/bin/env bash
# The RelayMoE paper's Table 3 scaling configs (configs/table3/*.yaml): E64..E384, K4..K16, H512..H2048.
#   examples/qwen3/table3.sh            # every config in turn, ring then alltoall, 50 steps each
#   examples/qwen3/table3.sh k16 e384   # just these
# Uses the same environment as train.sh; these configs are 8-GPU runs (NNODES=1 by default).
# Every run is attempted; the exit status is non-zero when any failed, and they are listed.
set -uo pipefail
export NNODES="${NNODES:-1}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in "$ROOT"/configs/table3/*.yaml; do names+=("$(basename "$f" .yaml)"); done
fi
failed=()
for n in "${names[@]}"; do
  for d in ring alltoall; do
    echo "=== table3/$n dispatcher=$d ==="
    if ! DISPATCHER=$d TRAIN_ITERS="${TRAIN_ITERS:-50}" "$HERE/train.sh" "table3/$n"; then
      echo "[relaymoe] table3/$n $d failed (above)" >&2
      failed+=("table3/$n:$d")
    fi
  done
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "[relaymoe] table3.sh: ${#failed[@]} of $((2 * ${#names[@]})) runs failed: ${failed[*]}" >&2
  exit 1
fi
echo "[relaymoe] table3.sh: all $((2 * ${#names[@]})) runs succeeded"
