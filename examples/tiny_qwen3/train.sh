#!/usr/bin/env bash
# The tiny Qwen3-style MoE (configs/tiny_qwen3.yaml: 4 MoE layers, 8 experts top-2) trained on
# 1 or 2 GPUs with --moe-token-dispatcher-type ring and with alltoall, same seed: prints loss,
# tokens/s and peak memory of both and how far the loss curves are apart.
#   examples/tiny_qwen3/train.sh [STEPS]            mock data (random tokens)
#   DATA=real examples/tiny_qwen3/train.sh [STEPS]  real text: a corpus made here from the
#       Python standard library's modules, a 1024-token BPE tokenizer trained on it, the corpus
#       tokenised by `relaymoe data` (into WORKDIR, default out/tiny_qwen3/; reused when there)
#   DATA_PATH=PREFIX TOKENIZER=DIR examples/tiny_qwen3/train.sh   your own dataset and tokenizer
#       (at most 1024 tokens: the config's vocabulary)
#   GPUS=1|2 to choose (default all visible, <= 2).
# Without a GPU it says so: with DATA=real it still prepares the data and prints the training
# command; otherwise it shows the memory planner's view of the config.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STEPS="${1:-${STEPS:-100}}"
DATA="${DATA:-mock}"
WORKDIR="${WORKDIR:-$ROOT/out/tiny_qwen3}"
die() { echo "[relaymoe] tiny_qwen3/train.sh: $*" >&2; exit 2; }
[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || die "STEPS=$STEPS must be a positive integer"

DATA_ARGS=()
if [ -n "${DATA_PATH:-}" ]; then
  [ -n "${TOKENIZER:-}" ] || die "DATA_PATH is set but TOKENIZER is not (relaymoe data prints both)"
  [ -f "$DATA_PATH.bin" ] && [ -f "$DATA_PATH.idx" ] \
    || die "DATA_PATH=$DATA_PATH: no $DATA_PATH.bin / .idx; make it with relaymoe data"
  [ -e "$TOKENIZER" ] || die "TOKENIZER=$TOKENIZER: no such file or directory"
  DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer "$TOKENIZER")
elif [ "$DATA" = real ]; then
  if [ ! -f "$WORKDIR/stdlib_text_document.json" ]; then  # relaymoe data's completion manifest
    echo "[relaymoe] preparing the real-data corpus in $WORKDIR" >&2
    "$PY" examples/tiny_qwen3/make_corpus.py "$WORKDIR"
  fi
  # a completed output is kept (relaymoe data checks its manifest), an interrupted one resumed;
  # its report and the flags it prints (after its "Megatron flags" header) go to stderr, this
  # script's stdout being the training command
  "$PY" -m relaymoe data --input "$WORKDIR/corpus.jsonl" --output-prefix "$WORKDIR/stdlib" \
    --tokenizer "$WORKDIR/tokenizer" --workers 2 >&2
  DATA_ARGS=(--data-path "$WORKDIR/stdlib_text_document" --tokenizer "$WORKDIR/tokenizer")
elif [ "$DATA" != mock ]; then
  die "DATA=$DATA: known: mock (default), real"
fi
GPU_ARGS=()
[ -n "${GPUS:-}" ] && GPU_ARGS=(--gpus "$GPUS")
# the end-to-end harness (benchmarks/e2e.py): one torchrun job per dispatcher, then the comparison
CMD=("$PY" -m benchmarks.e2e --config tiny_qwen3 --steps "$STEPS" "${GPU_ARGS[@]}" "${DATA_ARGS[@]}")
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "No CUDA GPU on this machine: the tiny training example needs 1 or 2 GPUs."
  if [ ${#DATA_ARGS[@]} -gt 0 ]; then
    echo "The data is ready; on a GPU machine this trains ring and alltoall on it:"
    printf '%q ' "${CMD[@]}"; echo
    exit 0
  fi
  echo "Showing relaymoe's plan for the config instead:"
  exec "$PY" -m relaymoe plan --config tiny_qwen3 --gpu h100-80gb
fi
exec "${CMD[@]}"
