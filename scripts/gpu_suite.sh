#!/usr/bin/env bash
# The GPU suite: GPU tests, every benchmark, the memory timeline, the EP-scaling simulation and
# the plots into one run folder, benchmarks/results/<date>_<gpu>x<n>_<commit12>/ with its
# manifest.json. The steps, their limits and the schedule live in benchmarks/suite.py.
#
#   bash scripts/gpu_suite.sh [--quick|--full] [--only STEP,STEP] [--dry-run] [--out DIR] ...
#
# --quick (default) fits one 10-minute device call; --full runs the larger sweeps (split it over
# calls with --only). Old knobs: SUITE_DEADLINE=S -> --deadline-s S; LIMIT_<step>=S -> --limit
# STEP=S; EXPERTS_ARGS="..." -> --extra experts="...". On the device machine ($OUT set, no --out):
# works in /tmp and leaves suite.tar.gz, manifest.json and triton_cache.tar.gz in $OUT. Carry
# (git-ignored): .whl/ (wheels, installed offline), .megatron_lm/ (Megatron-LM's pretrain_gpt.py
# for the launch test), .triton_cache.tar.gz (the previous call's cache: no re-tuning).
# `python -m benchmarks.suite --help` for every option.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
ARGS=("$@")
[ -n "${SUITE_DEADLINE:-}" ] && ARGS+=(--deadline-s "$SUITE_DEADLINE")
[ -n "${EXPERTS_ARGS:-}" ] && ARGS+=(--extra "experts=$EXPERTS_ARGS")
while IFS='=' read -r name value; do
  ARGS+=(--limit "${name#LIMIT_}=$value")
done < <(env | grep -E '^LIMIT_[a-z_]+=' || true)
if [ -n "${OUT:-}" ] && [[ " $* " != *" --out"* ]] && [[ " $* " != *" --handoff"* ]]; then
  ARGS+=(--handoff "$OUT")
fi
exec "$PY" -m benchmarks.suite "${ARGS[@]}"
