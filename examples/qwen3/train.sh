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
#   TRAIN_ITERS (500), SAVE_DIR (checkpoints; unset: no checkpoints)
#   PYTHON        the interpreter (default: the project's .venv/bin/python, made by scripts/test.sh)
#   DRY_RUN=1     check everything and print the launch command instead of running it
# The paper's setup (RelayMoE §4): 32 GPUs, TP=2 (+SP), CP=4, PP=4, EP=8, ETP=1 -- it is in the configs.
# Every check runs before anything is launched; a failed one stops here with a non-zero exit.
set -euo pipefail
CONFIG="${1:?usage: train.sh CONFIG [extra megatron args]}"; shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NNODES="${NNODES:-4}"; GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-29500}"
DISPATCHER="${DISPATCHER:-ring}"
TRAIN_ITERS="${TRAIN_ITERS:-500}"

die() { echo "[relaymoe] train.sh: $*; nothing was launched" >&2; exit 2; }

command -v "$PY" >/dev/null 2>&1 || die "no Python at $PY: run 'bash scripts/test.sh' once \
(it creates .venv with relaymoe installed), or set PYTHON to an interpreter that has it"
[[ "$NNODES" =~ ^[1-9][0-9]*$ && "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] \
  || die "NNODES=$NNODES and GPUS_PER_NODE=$GPUS_PER_NODE must be positive integers"
WORLD=$((NNODES * GPUS_PER_NODE))
[ -f "$CONFIG" ] && CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # relaymoe from this checkout

# Model, parallelism and batch flags come from the config; `relaymoe flags --world` refuses a
# layout that does not fill NNODES*GPUS_PER_NODE. Captured in a plain assignment (not inside
# `mapfile < <(...)`, whose failure bash ignores) so that a refusal stops the script.
if ! FLAGS="$("$PY" -m relaymoe flags --config "$CONFIG" --dispatcher "$DISPATCHER" \
    --world "$WORLD")"; then
  die "the config does not fit NNODES=$NNODES x GPUS_PER_NODE=$GPUS_PER_NODE = $WORLD GPUs (above)"
fi
mapfile -t MODEL_ARGS <<<"$FLAGS"

flag_value() {  # flag_value --name: its value in MODEL_ARGS (1 when absent)
  local i
  for ((i = 0; i < ${#MODEL_ARGS[@]} - 1; i++)); do
    [ "${MODEL_ARGS[i]}" = "$1" ] && { echo "${MODEL_ARGS[i + 1]}"; return; }
  done
  echo 1
}

TRAIN_ARGS=(--train-iters "$TRAIN_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
            --lr-warmup-iters 50 --clip-grad 1.0 --weight-decay 0.1 --adam-beta2 0.95
            --init-method-std 0.008 --log-interval 1 --eval-iters 0 --eval-interval 1000000
            --log-throughput --distributed-backend nccl)
if ! "$PY" -c "import transformer_engine" >/dev/null 2>&1; then
  CP="$(flag_value --context-parallel-size)"
  if [ "$CP" -gt 1 ]; then
    die "config $CONFIG uses context parallelism (CP=$CP), which Megatron runs only with \
TransformerEngine, and $PY cannot import transformer_engine; fix: install it into that \
environment ('$PY -m pip install -e \"$ROOT[te]\"', or transformer-engine[pytorch] matching \
your CUDA and torch), or use a config with parallel.cp: 1"
  fi
  echo "[relaymoe] TransformerEngine not found: using --transformer-impl local" >&2
  TRAIN_ARGS+=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm
              --no-masked-softmax-fusion)
fi

if [ -n "${DATA_PATH:-}" ]; then
  # shellcheck disable=SC2206
  DATA_ARGS=(--data-path $DATA_PATH --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
             --tokenizer-model "${TOKENIZER:-Qwen/Qwen3-30B-A3B}")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer)
fi
if [ -n "${SAVE_DIR:-}" ]; then
  TRAIN_ARGS+=(--save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 500 --ckpt-format torch_dist)
fi

if [ -n "${MEGATRON_LM_DIR:-}" ]; then
  [ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ] || die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR has no pretrain_gpt.py"
  ENTRY=(-m relaymoe.megatron.launch "$MEGATRON_LM_DIR/pretrain_gpt.py")
else
  ENTRY=(-m relaymoe.megatron.pretrain)
fi
CMD=("$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
     --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
     "${ENTRY[@]}" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
set -x
exec "${CMD[@]}"
