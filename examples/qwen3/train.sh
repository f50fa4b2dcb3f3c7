#!/usr/bin/env bash
# Multi-node Megatron training of a relaymoe config with --moe-token-dispatcher-type ring.
#
#   examples/qwen3/train.sh CONFIG [extra megatron args...]
#   CONFIG: qwen3_30b_a3b | qwen3_5_35b_a3b | qwen2_57b_a14b | table3/<name> | a YAML path
#
# One invocation per node (torchrun), or under SLURM via examples/qwen3/slurm.sbatch.
# Environment:
#   NNODES (4), GPUS_PER_NODE (8), NODE_RANK (0; SLURM_NODEID under srun), MASTER_ADDR, MASTER_PORT
#   DATA_PATH     Megatron indexed dataset prefix(es) ("1.0 /data/qwen_text_document"); unset: mock data
#   TOKENIZER     HF tokenizer name/path for real data (default Qwen/Qwen3-30B-A3B)
#   MEGATRON_LM_DIR  a Megatron-LM checkout: run its pretrain_gpt.py through relaymoe.megatron.launch;
#                 unset: relaymoe's self-contained python -m relaymoe.megatron.pretrain
#   DISPATCHER    ring (default) or alltoall, for a baseline with identical flags
#   TRAIN_ITERS (500), SAVE_DIR (checkpoints; unset: no checkpoints), PYTHON (python3)
# The paper's setup (RelayMoE §4): 32 GPUs, TP=2 (+SP), CP=4, PP=4, EP=8, ETP=1 -- it is in the configs.
set -euo pipefail
CONFIG="${1:?usage: train.sh CONFIG [extra megatron args]}"; shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"
NNODES="${NNODES:-4}"; GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-29500}"
DISPATCHER="${DISPATCHER:-ring}"
TRAIN_ITERS="${TRAIN_ITERS:-500}"

# Model, parallelism and batch flags come from the config (relaymoe.config.to_megatron_args).
mapfile -t MODEL_ARGS < <(cd "$ROOT" && "$PY" - "$CONFIG" "$DISPATCHER" <<'PYEOF'
import sys
from relaymoe.config import load_config, to_megatron_args
cfg = load_config(sys.argv[1])
world = int(__import__("os").environ.get("NNODES", "4")) * int(__import__("os").environ.get("GPUS_PER_NODE", "8"))
p = cfg.parallel
need = p.tp * p.cp * p.pp * p.dp
if need != world:
    sys.exit(f"{sys.argv[1]}: tp*cp*pp*dp = {need} GPUs but NNODES*GPUS_PER_NODE = {world}")
print("\n".join(to_megatron_args(cfg, dispatcher=sys.argv[2])))
PYEOF
)

if [ -n "${DATA_PATH:-}" ]; then
  # shellcheck disable=SC2206
  DATA_ARGS=(--data-path $DATA_PATH --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
             --tokenizer-model "${TOKENIZER:-Qwen/Qwen3-30B-A3B}")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer)
fi
TRAIN_ARGS=(--train-iters "$TRAIN_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
            --lr-warmup-iters 50 --clip-grad 1.0 --weight-decay 0.1 --adam-beta2 0.95
            --init-method-std 0.008 --log-interval 1 --eval-iters 0 --eval-interval 1000000
            --log-throughput --distributed-backend nccl)
if [ -n "${SAVE_DIR:-}" ]; then
  TRAIN_ARGS+=(--save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 500 --ckpt-format torch_dist)
fi
if ! "$PY" -c "import transformer_engine" >/dev/null 2>&1; then
  echo "[relaymoe] TransformerEngine not found: using --transformer-impl local (no CP>1 there)" >&2
  TRAIN_ARGS+=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm
              --no-masked-softmax-fusion)
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
if [ -n "${MEGATRON_LM_DIR:-}" ]; then
  ENTRY=(-m relaymoe.megatron.launch "$MEGATRON_LM_DIR/pretrain_gpt.py")
else
  ENTRY=(-m relaymoe.megatron.pretrain)
fi
set -x
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
  --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "${ENTRY[@]}" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}" "$@"
