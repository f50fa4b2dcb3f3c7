#!/usr/bin/env bash
# One command on the lent GPU machine with the suite's environment, its files bundled into $OUT.
#
#   bash scripts/device_run.sh 'CMD; CMD ...'
#
# Installs carried wheels (.whl/) into /tmp/site, seeds the Triton cache from a carried
# .triton_cache.tar.gz, exports WORK (a fresh folder for the command's files), runs the command
# with bash, then puts WORK as work.tar.gz and the Triton cache as triton_cache.tar.gz into $OUT
# (carry that back as .triton_cache.tar.gz for the next call). Never sets NVLink multicast.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >/tmp/pip_install.log 2>&1 || echo "[device_run] wheel install failed: /tmp/pip_install.log"
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/relaymoe_triton_cache}" TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton_cache.tar.gz ] && tar -xaf .triton_cache.tar.gz -C "$TRITON_CACHE_DIR"
# the commit of this tree: git's answer only where ROOT is itself a checkout's top (a carried
# `git archive` copy has no .git, and git would answer for a checkout around it); else pass
# RELAYMOE_COMMIT in the environment: RELAYMOE_COMMIT=<sha> bash scripts/device_run.sh '...'
if [ -z "${RELAYMOE_COMMIT:-}" ]; then
  RELAYMOE_COMMIT=unknown
  if [ "$(git -C "$ROOT" rev-parse --show-toplevel 2>/dev/null)" = "$ROOT" ]; then
    RELAYMOE_COMMIT="$(git -C "$ROOT" rev-parse --short=12 HEAD)"
  fi
fi
export RELAYMOE_COMMIT
export WORK=/tmp/relaymoe_work
rm -rf "$WORK"; mkdir -p "$WORK"
echo "[device_run] commit $RELAYMOE_COMMIT; $(nvidia-smi -L | wc -l) GPUs"
bash -c "$1" 2>&1 | tee "$WORK/device_run.log"
rc=${PIPESTATUS[0]}
OUT="${OUT:-$ROOT/out}"; mkdir -p "$OUT"
tar -czf "$OUT/work.tar.gz" -C "$WORK" .
(cd "$TRITON_CACHE_DIR" && XZ_OPT=-T0 tar -cJf "$OUT/triton_cache.tar.gz" .)
echo "[device_run] rc=$rc; $(du -h "$OUT/work.tar.gz" | cut -f1) work, $(du -h "$OUT/triton_cache.tar.gz" | cut -f1) cache"
exit "$rc"
