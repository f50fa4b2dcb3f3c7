#!/usr/bin/env bash
# Multi-node Megatron training of a relaymoe config with --moe-token-dispatcher-type ring.
#
#   examples/qwen3/train.sh CONFIG [extra megatron args...]
#   CONFIG: qwen3_30b_a3b | qwen3_5_35b_a3b | qwen2_57b_a14b | table3/<name> | a YAML path
#
# One invocation per node (torchrun), or under SLURM via examples/qwen3/slurm.sbatch.
# examples/qwen3/README.md is the walk-through. Environment:
#   NNODES (4), GPUS_PER_NODE (8), NODE_RANK (0; SLURM_NODEID under srun), MASTER_ADDR (node 0's
#                 address: required when NNODES > 1; localhost on one node), MASTER_PORT (29500)
#   DATA_PATH     Megatron indexed dataset prefix(es) ("/data/qwen_text_document", or weighted
#                 "0.7 /data/a_text_document 0.3 /data/b_text_document"); unset: mock data
#   TOKENIZER     with DATA_PATH: the local Hugging Face tokenizer folder the data was made with
#   PRETRAINED    a Megatron checkpoint to start from (relaymoe convert-hf --out ...)
#   SAVE_DIR      checkpoints, saved every SAVE_INTERVAL (500) iterations and resumed from when
#                 the folder holds one; unset: no checkpoints
#   MEGATRON_LM_DIR  a Megatron-LM checkout: run its pretrain_gpt.py through relaymoe.megatron.launch;
#                 unset: relaymoe's self-contained python -m relaymoe.megatron.pretrain
#   DISPATCHER    ring (default) or alltoall, for a baseline with identical flags
#   TRAIN_ITERS (500), PYTHON (default: the project's .venv/bin/python, made by scripts/test.sh)
#   DRY_RUN=1     check everything, print the launch command and what the run needs; launch nothing
# The paper's setup (RelayMoE §4): 32 GPUs, TP=2 (+SP), CP=4, PP=4, EP=8, ETP=1 -- it is in the configs.
# Every check runs before anything is launched (relaymoe/megatron/preflight.py: the cluster, the
# data, the tokenizer, the checkpoint the run reads, the options); a failed one stops here with
# exit status 2 and one line per problem, its fix included.
set -euo pipefail
CONFIG="${1:?usage: train.sh CONFIG [extra megatron args]}"; shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NNODES="${NNODES:-4}"; GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
MASTER_GIVEN="${MASTER_ADDR:-}"  # required across nodes (the preflight checks it)
MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-29500}"
DISPATCHER="${DISPATCHER:-ring}"
TRAIN_ITERS="${TRAIN_ITERS:-500}"
SAVE_INTERVAL="${SAVE_INTERVAL:-500}"
DRY="${DRY_RUN:-0}"

die() { echo "[relaymoe] train.sh: $*; nothing was launched" >&2; exit 2; }

command -v "$PY" >/dev/null 2>&1 || die "no Python at $PY: run 'bash scripts/test.sh' once \
(it creates .venv with relaymoe installed), or set PYTHON to an interpreter that has it"
[[ "$NNODES" =~ ^[1-9][0-9]*$ && "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] \
  || die "NNODES=$NNODES and GPUS_PER_NODE=$GPUS_PER_NODE must be positive integers"
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] && [ "$NODE_RANK" -lt "$NNODES" ] \
  || die "NODE_RANK=$NODE_RANK must be an integer in [0, NNODES=$NNODES) (this node's index)"
[[ "$TRAIN_ITERS" =~ ^[1-9][0-9]*$ && "$SAVE_INTERVAL" =~ ^[1-9][0-9]*$ ]] \
  || die "TRAIN_ITERS=$TRAIN_ITERS and SAVE_INTERVAL=$SAVE_INTERVAL must be positive integers"
[[ "$MASTER_PORT" =~ ^[1-9][0-9]*$ ]] || die "MASTER_PORT=$MASTER_PORT must be a port number"
WORLD=$((NNODES * GPUS_PER_NODE))
[ -f "$CONFIG" ] && CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # relaymoe from this checkout

# Model, parallelism and batch flags come from the config; `relaymoe flags --world` refuses a
# layout that does not fill NNODES*GPUS_PER_NODE. Captured in a plain assignment (not inside
# `mapfile < <(...)`, whose failure bash ignores) so that a refusal stops the script; its
# message is the error, reported once. One flag and its values per line (no value has a space).
ERRF="$(mktemp)"; trap 'rm -f "$ERRF"' EXIT
if ! FLAGS="$("$PY" -m relaymoe flags --config "$CONFIG" --dispatcher "$DISPATCHER" \
    --world "$WORLD" 2>"$ERRF")"; then
  die "$(sed -e 's/^relaymoe flags: error: //' "$ERRF")"
fi
MODEL_ARGS=()
while read -r -a WORDS; do MODEL_ARGS+=("${WORDS[@]}"); done <<<"$FLAGS"
NOTES=()  # printed once the checks pass

flag_value() {  # flag_value --name: its value in MODEL_ARGS (1 when absent)
  local i
  for ((i = 0; i < ${#MODEL_ARGS[@]} - 1; i++)); do
    [ "${MODEL_ARGS[i]}" = "$1" ] && { echo "${MODEL_ARGS[i + 1]}"; return; }
  done
  echo 1
}
CP="$(flag_value --context-parallel-size)"
VOCAB="$(flag_value --vocab-size)"

TRAIN_ARGS=(--train-iters "$TRAIN_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
            --lr-warmup-iters 50 --clip-grad 1.0 --weight-decay 0.1 --adam-beta2 0.95
            --init-method-std 0.008 --log-interval 1 --eval-iters 0 --eval-interval 1000000
            --log-throughput --distributed-backend nccl)
HAVE_TE=1
"$PY" -c "import transformer_engine" >/dev/null 2>&1 || HAVE_TE=0
if [ "$HAVE_TE" = 0 ] && [ "$CP" -eq 1 ]; then
  NOTES+=("TransformerEngine not found: using --transformer-impl local")
  TRAIN_ARGS+=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm
              --no-masked-softmax-fusion)
fi  # CP > 1 without TE: the command is the TE one; the preflight refuses it (a dry run says so)

DATA_ARGS=()
if [ -n "${DATA_PATH:-}" ]; then
  [ -n "${TOKENIZER:-}" ] || die "DATA_PATH is set but TOKENIZER is not: set TOKENIZER to the \
local tokenizer folder the data was made with ('relaymoe data' prints both)"
  # shellcheck disable=SC2206
  DATA_ARGS=(--data-path $DATA_PATH --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
             --tokenizer-model "$TOKENIZER")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer)
fi
# TE's attention makes the causal mask itself: no (seq x seq) mask per sample from the loader
[ "$HAVE_TE" = 1 ] && DATA_ARGS+=(--no-create-attention-mask-in-dataloader)
# The embedding keeps the config's rows (Megatron would pad the tokenizer's length otherwise,
# and a converted checkpoint has the config's vocab_size rows).
[ -n "${DATA_PATH:-}${PRETRAINED:-}" ] && DATA_ARGS+=(--padded-vocab-size "$VOCAB")

CKPT_ARGS=()
if [ -n "${SAVE_DIR:-}" ]; then
  CKPT_ARGS+=(--save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval "$SAVE_INTERVAL"
              --ckpt-format torch_dist)
  # PRETRAINED is read only while SAVE_DIR holds no checkpoint (Megatron's finetune start)
  [ -n "${PRETRAINED:-}" ] && CKPT_ARGS+=(--pretrained-checkpoint "$PRETRAINED")
  if [ "$HAVE_TE" = 0 ] && printf '%s\n' "${MODEL_ARGS[@]}" | grep -qx -- --use-distributed-optimizer \
     && ! "$PY" -c "import apex" >/dev/null 2>&1; then
    # megatron-core 0.19.2's distributed optimizer cannot load its own state without TE or Apex
    NOTES+=("no TransformerEngine or Apex: a resumed run loads the weights, iteration and RNG \
state but not the optimizer state (--no-load-optim; Adam's moments restart)")
    CKPT_ARGS+=(--no-load-optim)
  fi
elif [ -n "${PRETRAINED:-}" ]; then
  CKPT_ARGS+=(--load "$PRETRAINED" --ckpt-format torch_dist)
fi

if [ -n "${MEGATRON_LM_DIR:-}" ]; then
  [ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ] || die "MEGATRON_LM_DIR=$MEGATRON_LM_DIR has no pretrain_gpt.py"
  ENTRY=(-m relaymoe.megatron.launch "$MEGATRON_LM_DIR/pretrain_gpt.py")
else
  ENTRY=(-m relaymoe.megatron.pretrain)
fi
ARGS=("${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}" "${CKPT_ARGS[@]}" "$@")
CMD=("$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
     --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
     "${ENTRY[@]}" "${ARGS[@]}")

# The cluster, the data, the tokenizer, the checkpoint the run reads, the whole command line
# through Megatron's own parser and the launch's option checks, and what the run needs
# (relaymoe/megatron/preflight.py); each problem is one line on stderr, then exit status 2.
CHECK=(--vocab-size "$VOCAB" --have-te "$HAVE_TE" --nnodes "$NNODES"
       --gpus-per-node "$GPUS_PER_NODE" --master-addr "$MASTER_GIVEN" --master-port "$MASTER_PORT")
[ -n "${DATA_PATH:-}" ] && CHECK+=(--data-path "$DATA_PATH" --tokenizer "$TOKENIZER")
[ -n "${PRETRAINED:-}" ] && CHECK+=(--pretrained "$PRETRAINED")
[ -n "${SAVE_DIR:-}" ] && CHECK+=(--save-dir "$SAVE_DIR")
if [ "$DRY" = 1 ]; then
  CHECK+=(--dry-run)
else  # the GPUs torchrun's processes will see on this node
  GPUS_SEEN="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
  CHECK+=(--visible-gpus "${GPUS_SEEN:-0}")
fi
"$PY" -m relaymoe.megatron.preflight "${CHECK[@]}" -- "${ARGS[@]}" || exit 2
for note in "${NOTES[@]}"; do echo "[relaymoe] $note" >&2; done

if [ "$DRY" = 1 ]; then
  {
    echo "[relaymoe] dry run, config $CONFIG: $NNODES node(s) x $GPUS_PER_NODE GPUs = $WORLD \
(this is node $NODE_RANK; the others run the same with their NODE_RANK)"
    echo "[relaymoe] data: ${DATA_PATH:-mock data}; checkpoints: ${SAVE_DIR:-none}; \
starting from: ${PRETRAINED:-random initialisation}"
    echo "[relaymoe] the launch command (stdout):"
  } >&2
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
set -x
exec "${CMD[@]}"
