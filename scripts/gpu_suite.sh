#!/usr/bin/env bash
# The GPU evidence suite: GPU tests, every benchmark, the memory timeline, the EP-scaling
# simulation and the plots, into one flat results folder.
#
#   bash scripts/gpu_suite.sh [--quick|--full] [--only STEP,STEP...] [OUTDIR]
#
# OUTDIR defaults to benchmarks/results/<date> (on the device machine, see below).
# --quick (default) fits one 10-minute device call (~9 minutes, SUITE_DEADLINE);
# --full runs the larger sweeps with longer limits: split it over calls with --only.
# Steps: ring e2e gpu_tests_dist ablation memory_timeline (2 GPUs); ring_wide (more than 2 GPUs:
# the ring benchmark at EP = every GPU); gpu_tests_kernels experts
# routing memory_model (1 GPU; two lanes with 2 GPUs); scaling_sim plots (CPU)
# EXPERTS_ARGS adds arguments to the experts step (e.g. "--shapes qwen3_30b_a3b_T64k");
# LIMIT_<step>=SECONDS overrides a step's cap (e.g. LIMIT_experts=300); SUITE_DEADLINE=SECONDS
# caps the whole run (quick default 530: a step that would end later gets a shorter limit).
# Each step runs under `timeout`; a failing step is logged and the others still run. Exit codes
# and durations go to OUTDIR/suite_summary.json. Needs python3 with torch + triton (+ megatron-core,
# liger-kernel for the competitors); wheels in .whl/ are installed to /tmp/site first (no network).
# On the device machine: `bash scripts/gpu_suite.sh --quick` ($OUT set, no OUTDIR) works in
# /tmp/relaymoe_suite and puts suite.tar.gz (every result file), suite_summary.json and
# triton_cache.tar.gz into $OUT. Carry (git-ignored): .whl/ (megatron-core, liger-kernel wheels),
# .megatron_lm/ (Megatron-LM's pretrain_gpt.py, gpt_builders.py, model_provider.py, for the
# launch test), .triton_cache.tar.gz (the previous call's triton_cache.tar.gz).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE=quick
ONLY=""
OUTDIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) MODE=quick ;;
    --full) MODE=full ;;
    --only) ONLY="$2"; shift ;;
    --only=*) ONLY="${1#--only=}" ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "gpu_suite.sh: unknown option $1 (use --quick, --full, --only STEPS, OUTDIR)" >&2; exit 2 ;;
    *) OUTDIR="$1" ;;
  esac
  shift
done
HANDOFF=""  # on the device machine ($OUT set, no OUTDIR): results go to a scratch folder and
# only suite.tar.gz, suite_summary.json and the Triton cache are copied into $OUT at the end
# (the device tool returns at most 8 files).
if [ -z "$OUTDIR" ] && [ -n "${OUT:-}" ]; then
  # a fresh scratch folder: a host reused between calls once kept an older call's rows there
  HANDOFF="$OUT"; OUTDIR=/tmp/relaymoe_suite; rm -rf "$OUTDIR"
fi
OUTDIR="${OUTDIR:-$ROOT/benchmarks/results/$(date +%Y-%m-%d)}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
PY="${PYTHON:-python3}"
SUITE_T0=$(date +%s)

log() { echo "[gpu_suite $(date +%H:%M:%S) +$(( $(date +%s) - SUITE_T0 ))s] $*"; }

# Mandatory on the lent H200 machines: no NVLink multicast / NVLS.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Compile Triton kernels for the GPU (tests/conftest.py only turns the interpreter on without CUDA).
export TRITON_INTERPRET=0
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  log "installing carried wheels from .whl/ into /tmp/site (no index, no deps)"
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    >"$OUTDIR/pip_install.log" 2>&1 || log "wheel install failed: see pip_install.log"
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if [ -z "${RELAYMOE_COMMIT:-}" ]; then
  RELAYMOE_COMMIT="$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || true)"
  [ -z "$RELAYMOE_COMMIT" ] && [ -f "$ROOT/.relaymoe_commit" ] && RELAYMOE_COMMIT="$(cat "$ROOT/.relaymoe_commit")"
fi
[ -n "${RELAYMOE_COMMIT:-}" ] && export RELAYMOE_COMMIT
# Triton's kernel cache, with autotuning results (TRITON_CACHE_AUTOTUNING): seeded from a carried
# .triton_cache.tar.gz (a previous call's triton_cache.tar.gz), returned with the results, so a
# later call on the same kind of GPU skips the compiles and tunings it already did.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/relaymoe_triton_cache}" TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
if [ -f "$ROOT/.triton_cache.tar.gz" ]; then
  tar -xaf "$ROOT/.triton_cache.tar.gz" -C "$TRITON_CACHE_DIR" || log "could not unpack the cache"
fi
# A Megatron-LM checkout for the launch test (pretrain_gpt.py and its sibling modules, test only).
if [ -z "${MEGATRON_LM_DIR:-}" ] && [ -f "$ROOT/.megatron_lm/pretrain_gpt.py" ]; then
  export MEGATRON_LM_DIR="$ROOT/.megatron_lm"
fi

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NGPU=${NGPU:-0}
log "mode=$MODE outdir=$OUTDIR gpus=$NGPU commit=${RELAYMOE_COMMIT:-unknown}"
nvidia-smi -L 2>/dev/null | sed 's/^/    /'
"$PY" - <<'EOF' 2>&1 | sed 's/^/    /'
import importlib
for m in ("torch", "triton", "megatron.core", "liger_kernel", "matplotlib"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"{m} missing ({type(e).__name__})")
EOF

if [ "$MODE" = quick ]; then
  QFLAG="--quick"
  # Caps, not expectations. Measured on 2x H200 (2026-11-30 s4 run1, Triton cache carried): ring
  # 44 s, e2e 111, ablation 17, routing 9, memory_model 43, experts (qwen3 T32k) 18, kernel
  # tests 14, dist tests 76, memory_timeline 34; 375 s in all. Order: timed 2-GPU steps (with
  # more than 2 GPUs, ring_wide: the ring at EP = every GPU), timed 1-GPU lanes, untimed steps
  # side by side. SUITE_DEADLINE (default 530 s) shortens any cap that would run past it.
  declare -A LIMIT=([gpu_tests_dist]=120 [gpu_tests_kernels]=160 [routing]=25 [experts]=170
                    [ring]=150 [ring_wide]=120 [ablation]=45 [e2e]=170 [memory_model]=100
                    [memory_timeline]=45 [scaling_sim]=15 [plots]=20)
  DEADLINE="${SUITE_DEADLINE:-530}"
else
  QFLAG=""
  declare -A LIMIT=([gpu_tests_dist]=400 [gpu_tests_kernels]=400 [routing]=240 [experts]=420
                    [ring]=540 [ring_wide]=540 [ablation]=300 [e2e]=540 [memory_model]=300
                    [memory_timeline]=120 [scaling_sim]=60 [plots]=60)
  DEADLINE="${SUITE_DEADLINE:-0}"  # 0: none (split --full over calls with --only)
fi

for step in "${!LIMIT[@]}"; do  # LIMIT_<step>=SECONDS in the environment overrides a cap
  override="LIMIT_$step"
  [ -n "${!override:-}" ] && LIMIT[$step]="${!override}"
done

SUMMARY_TSV="$OUTDIR/.suite_steps.tsv"
: >"$SUMMARY_TSV"

want() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# run_step NAME LIMIT_S CMD... : runs CMD under timeout, output to NAME.log, records rc.
run_step() {
  local name="$1" limit="$2"; shift 2
  want "$name" || return 0
  if [ "$DEADLINE" -gt 0 ]; then  # keep 45 s: CPU steps, summary, bundles, timeout's kill grace
    local left=$(( DEADLINE - ($(date +%s) - SUITE_T0) - 45 ))
    case "$name" in scaling_sim|plots) left=$(( left + 25 )) ;; esac
    if [ "$left" -lt 10 ]; then skip_step "$name" "suite deadline ${DEADLINE}s reached"; return 0; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  log "START $name (limit ${limit}s): $*"
  local t0=$SECONDS rc
  timeout --kill-after=15 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
  rc=$?
  local dt=$(( SECONDS - t0 ))
  tail -n 25 "$OUTDIR/$name.log" | sed "s/^/    [$name] /"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    log "TIMEOUT $name after ${dt}s (rc=$rc)"
  else
    log "END $name rc=$rc in ${dt}s"
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$name.log" >>"$SUMMARY_TSV"
}

skip_step() {  # skip_step NAME REASON
  want "$1" || return 0
  log "SKIP $1: $2"
  printf '%s\t%s\t%s\t%s\n' "$1" "skipped" 0 "$2" >>"$SUMMARY_TSV"
}

# bench NAME FILE RANKS [extra args]: RANKS 1 (plain process), 2 or all (torchrun, a rank per GPU)
bench() {
  local name="$1" file="$2" ranks="$3"; shift 3
  if [ ! -f "$file" ]; then skip_step "$name" "$file not present"; return; fi
  [ "$ranks" = all ] && ranks=$NGPU
  if [ "$ranks" -ge 2 ]; then
    if [ "$NGPU" -lt "$ranks" ]; then skip_step "$name" "needs $ranks GPUs, found $NGPU"; return; fi
    run_step "$name" "${LIMIT[$name]}" torchrun --standalone --nproc-per-node "$ranks" "$file" \
      $QFLAG --out "$OUTDIR/$name.jsonl" "$@"
  else
    run_step "$name" "${LIMIT[$name]}" "$PY" "$file" $QFLAG --out "$OUTDIR/$name.jsonl" "$@"
  fi
}


# gpu_tests_kernels: one GPU. gpu_tests_dist: the tests that need 2 GPUs (ring over NCCL and the
# copy engines; Megatron e2e). --quick leaves the 200-step loss parity to the e2e step (the same
# run, measured) and the dist-checkpoint round trip (four torchrun jobs) to --full.
gpu_tests_kernels() {
  run_step gpu_tests_kernels "${LIMIT[gpu_tests_kernels]}" "$PY" -m pytest -q -ra \
    tests/gpu/test_kernels_gpu.py --timeout 45 --junitxml="$OUTDIR/gpu_tests_kernels.xml" \
    -p no:cacheprovider
}
gpu_tests_dist() {
  local deselect=()
  [ "$MODE" = quick ] && deselect=(--deselect
    tests/gpu/test_e2e_gpu.py::test_tiny_qwen3_ring_vs_alltoall_200_steps --deselect
    tests/gpu/test_e2e_gpu.py::test_checkpoint_alltoall_resumes_with_ring)
  local per_test=100  # --full's 200-step parity and checkpoint round trip run several jobs each
  [ "$MODE" = quick ] || per_test=380
  run_step gpu_tests_dist "${LIMIT[gpu_tests_dist]}" "$PY" -m pytest -q -ra \
    tests/gpu/test_ring_gpu.py tests/gpu/test_e2e_gpu.py --timeout "$per_test" "${deselect[@]}" \
    --junitxml="$OUTDIR/gpu_tests_dist.xml" -p no:cacheprovider
}
single_gpu_step() {  # the steps that use one GPU, by name
  case "$1" in
    gpu_tests_kernels) gpu_tests_kernels ;;
    experts) bench experts benchmarks/bench_experts.py 1 ${EXPERTS_ARGS:-} ;;
    routing) bench routing benchmarks/bench_routing.py 1 --rep-ms 50 ;;
    memory_model) bench memory_model benchmarks/validate_memory_model.py 1 ;;
  esac
}
lane() {  # lane GPU STEP...: the steps one after another on that GPU
  local gpu="$1"; shift
  local step
  for step in "$@"; do CUDA_VISIBLE_DEVICES="$gpu" single_gpu_step "$step"; done
}

if [ "$NGPU" -ge 2 ]; then
  # Timed steps alone on their GPUs, most important first, so a late overrun costs the least;
  # then the untimed ones (correctness, memory) side by side, where sharing a GPU is harmless.
  ring_sweeps=()  # --quick sweeps T and I by default; the full set asks for the full sweeps
  [ "$MODE" = quick ] || ring_sweeps=(--seq --crossover)
  bench ring benchmarks/bench_ring.py 2 "${ring_sweeps[@]}"
  # More than 2 GPUs: the ring and both all-to-alls at EP = all of them (the main shape and the
  # T sweep), real rows beside the simulation's at that EP.
  [ "$NGPU" -gt 2 ] && bench ring_wide benchmarks/bench_ring.py all --no-crossover \
    ${ring_sweeps[0]:+--seq}
  bench e2e benchmarks/bench_e2e.py 1  # launches its own torchrun jobs (one per dispatcher)
  bench ablation benchmarks/ablation.py 2
  log "timed single-GPU steps in two lanes (GPU 0 and GPU 1)"
  lane 0 routing memory_model &  # memory_model measures memory, not time
  lane 1 experts &
  wait
  log "untimed steps side by side: kernel tests on GPU 0 beside the 2-GPU tests"
  lane 0 gpu_tests_kernels &
  {
    want gpu_tests_dist && gpu_tests_dist
    if [ -f benchmarks/memory_timeline.py ]; then
      run_step memory_timeline "${LIMIT[memory_timeline]}" torchrun --standalone \
        --nproc-per-node 2 benchmarks/memory_timeline.py $QFLAG \
        --out "$OUTDIR/memory_timeline.jsonl"
    fi
  } &
  wait
elif [ "$NGPU" -ge 1 ]; then
  lane 0 gpu_tests_kernels experts routing memory_model
  if [ -f benchmarks/memory_timeline.py ]; then
    run_step memory_timeline "${LIMIT[memory_timeline]}" "$PY" benchmarks/memory_timeline.py \
      $QFLAG --out "$OUTDIR/memory_timeline.jsonl"
  fi
  for s in ring ablation e2e gpu_tests_dist; do skip_step "$s" "needs 2 GPUs, found $NGPU"; done
else
  log "no NVIDIA GPU found: GPU steps are skipped (the simulation and plots still run)"
  for s in gpu_tests_kernels gpu_tests_dist routing experts ring ablation e2e memory_model \
    memory_timeline; do
    skip_step "$s" "no GPU"
  done
fi
# The simulation calibrates on the committed rows and this run's, which replace the committed
# rows of the same measurement (the last row of each identity counts).
run_step scaling_sim "${LIMIT[scaling_sim]}" "$PY" benchmarks/scaling_sim.py $QFLAG \
  --out "$OUTDIR/scaling_sim.jsonl" --rows "$ROOT/benchmarks/results/**/*.jsonl" "$OUTDIR/*.jsonl"
run_step plots "${LIMIT[plots]}" "$PY" benchmarks/plots.py --results "$OUTDIR" --out "$OUTDIR"

# Summary (JSON) from the step table.
"$PY" - "$SUMMARY_TSV" "$OUTDIR/suite_summary.json" "$MODE" "$NGPU" "$SUITE_T0" <<'EOF'
import json, sys, time, datetime, os
tsv, out, mode, ngpu, t0 = sys.argv[1:6]
steps = []
for line in open(tsv):
    name, rc, dt, what = line.rstrip("\n").split("\t")
    st = {"step": name, "seconds": int(dt)}
    if rc == "skipped":
        st.update(status="skipped", reason=what)
    else:
        rc = int(rc)
        st.update(rc=rc, log=what,
                  status="ok" if rc == 0 else ("timeout" if rc in (124, 137) else "failed"))
    steps.append(st)
summary = {
    "mode": mode, "gpus": int(ngpu), "commit": os.environ.get("RELAYMOE_COMMIT", "unknown"),
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "seconds": int(time.time() - int(t0)), "steps": steps,
    "failed": [s["step"] for s in steps if s["status"] in ("failed", "timeout")],
}
json.dump(summary, open(out, "w"), indent=1)
EOF
rm -f "$SUMMARY_TSV"
log "summary: $OUTDIR/suite_summary.json"
"$PY" -c "import json,sys; s=json.load(open(sys.argv[1])); [print(f\"    {x['step']:16s} {x['status']:8s} {x.get('rc','')!s:4s} {x['seconds']}s {x.get('reason','')}\") for x in s['steps']]; print('    failed:', s['failed'] or 'none')" "$OUTDIR/suite_summary.json"

# The device tool returns at most 8 files: bundle everything when there are more.
NFILES=$(find "$OUTDIR" -maxdepth 1 -type f ! -name suite.tar.gz | wc -l)
if [ "$NFILES" -gt 8 ] || [ -n "$HANDOFF" ]; then
  # Written outside OUTDIR: a bundle growing inside the folder it reads makes tar warn.
  tar -czf /tmp/relaymoe_suite_bundle.tar.gz -C "$OUTDIR" --exclude=suite.tar.gz .
  mv /tmp/relaymoe_suite_bundle.tar.gz "$OUTDIR/suite.tar.gz"
  log "bundled $NFILES files into suite.tar.gz ($(du -h "$OUTDIR/suite.tar.gz" | cut -f1))"
fi
# The Triton cache for the next call (carry it as .triton_cache.tar.gz), under what one returned
# file may hold: whole if it fits, else relaymoe's kernels and every autotuning result, else only
# the autotuning results (then the next call compiles, but does not re-tune).
CACHE_TGZ=/tmp/relaymoe_triton_cache.tar.gz
CACHE_CAP=$(( 15 * 1024 * 1024 ))
RELAYMOE_KERNELS="$(grep -h -A1 '^@triton.jit' relaymoe/kernels/*.py | sed -n 's/^def \([a-z_0-9]*\)(.*/\1/p' \
  | paste -sd'|')"
cache_fits() { [ -f "$CACHE_TGZ" ] && [ "$(stat -c %s "$CACHE_TGZ")" -le "$CACHE_CAP" ]; }
export XZ_OPT="-T0"
(cd "$TRITON_CACHE_DIR" && tar -cJf "$CACHE_TGZ" .) 2>/dev/null
if ! cache_fits; then
  (cd "$TRITON_CACHE_DIR" && { find . -name '*.autotune.json'; grep -l -r --include='*.json' -E \
    -e "\"name\": \"($RELAYMOE_KERNELS)\"" . | xargs -r -n1 dirname; } | sort -u | tar -cJf "$CACHE_TGZ" -T -) 2>/dev/null
fi
if ! cache_fits; then
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -cJf "$CACHE_TGZ" -T -) 2>/dev/null
fi
[ -f "$CACHE_TGZ" ] && log "triton cache for the next call: $(du -h "$CACHE_TGZ" | cut -f1)"
if [ -n "$HANDOFF" ]; then
  cp "$OUTDIR/suite.tar.gz" "$OUTDIR/suite_summary.json" "$HANDOFF/"
  [ -f "$CACHE_TGZ" ] && cp "$CACHE_TGZ" "$HANDOFF/triton_cache.tar.gz"
  log "copied suite.tar.gz, suite_summary.json, triton_cache.tar.gz into $HANDOFF"
fi
log "done in $(( $(date +%s) - SUITE_T0 ))s"
FAILED=$("$PY" -c "import json,sys; print(len(json.load(open(sys.argv[1]))['failed']))" "$OUTDIR/suite_summary.json")
[ "$FAILED" = 0 ]
