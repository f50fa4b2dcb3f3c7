"""The GPU suite: GPU tests, every benchmark, the memory timeline, the EP-scaling simulation and
the plots, as a table of steps run through subprocess with time limits into one run folder.

    python -m benchmarks.suite [--quick | --full] [--only a,b] [--gpus N] [--out DIR]
                               [--handoff DIR] [--deadline-s S] [--dry-run]

``STEPS`` holds each step's name, GPUs, command and time limits. Steps run in phases (``PHASES``);
within a phase every lane runs at once, the steps of one lane one after another: ``all`` (the
2-GPU steps, one at a time, alone on the machine while they are timed), ``gpu0`` / ``gpu1`` (a
one-GPU step pinned by ``CUDA_VISIBLE_DEVICES``; on a one-GPU machine both lanes are GPU 0, run
one after the other) and ``cpu``. A step that needs more GPUs than the machine has, or whose
script is absent, is ``skipped``; a step runs in its own process group under its limit and is
killed (``timeout``) when it overruns; a failing step never stops the others.

``--quick`` (the default) is meant to finish inside one 10-minute device call on a fresh
2x H200 with an empty Triton cache: the benchmarks' quick shape sets (one experts shape, qwen3
T32k), the tests and the memory measurements with ``RELAYMOE_AUTOTUNE=0`` (one tile config per
kernel: they check values and bytes, not time, so they skip the autotuning that a cold cache pays
per shape), and a suite deadline (``--deadline-s``, default 540 s) that shortens any limit that
would end later and skips what no longer fits. A carried ``.triton_cache.tar.gz`` (the previous
call's ``triton_cache.tar.gz``) seeds the cache, autotuning results included, so the timed steps
do not re-tune either. ``--full`` runs the larger sweeps under longer limits and no deadline:
split it over calls with ``--only``.

Output: the run folder ``benchmarks/results/<date>_<gpu>x<n>_<commit12>/`` (``benchmarks/runs.py``;
``--out`` names another) holding each step's rows, ``<step>.log`` and ``manifest.json``, which is
rewritten after every step: the command, commit, whether the tree was clean, GPU, versions, and
per step ``name``, ``status`` (ok / failed / timeout / skipped), ``seconds``, ``files``,
``command``, ``limit_s`` (and ``rc``, or the ``reason`` of a skip). Exit status 1 when a step
failed or timed out. On a tree without ``.git`` (a device copy) the commit comes from
``RELAYMOE_COMMIT`` (or ``.relaymoe_commit``); ``RELAYMOE_TREE_CLEAN=1`` states that the tree is
that commit unmodified (e.g. a ``git archive``). ``--handoff DIR`` (the device machine's ``$OUT``)
works in a scratch folder and leaves only ``suite.tar.gz`` (the run folder), ``manifest.json``
and ``triton_cache.tar.gz`` in DIR.

``--dry-run`` prints the plan (order, lanes, limits, commands, what would be skipped) and runs
nothing; without a GPU it plans for 2 (``--gpus`` to choose). Pure Python, no torch.

Ad hoc steps (``--step NAME=COMMAND``, repeatable) replace the table for one device call: each
runs ``python COMMAND`` (a script under the repository, or ``-m module``, then its arguments;
``{out}`` is the run folder) on GPU 0, in the order given, with the same limits, logs and
manifest. The files named ``NAME*`` in the run folder are that step's. On the lent machine::

    RELAYMOE_COMMIT=<sha12> RELAYMOE_TREE_CLEAN=1 python3 -m benchmarks.suite --handoff $OUT \
        --step sweep='benchmarks/lab/sweep_kernels.py --kernels rows --out {out}/sweep.jsonl' \
        --step gpu_tests='-m pytest -q tests/gpu/test_gather_ws_gpu.py'

then ``python -m benchmarks.runs unpack suite.tar.gz`` puts the run folder under
``benchmarks/results/`` (a second call at one commit and date becomes ``<name>-2``), with its
manifest (name, order, versions, each step's command, time and files).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import runs  # noqa: E402
from benchmarks.processes import stop_tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ALL = "all"  # a step's ranks: one per GPU of the machine
KILL_GRACE_S = 15  # SIGTERM, then SIGKILL this much later
MIN_STEP_S = 10  # a step with less than this left before the deadline is not started
RESERVE_S = 30  # kept free before the deadline: summary, bundles, the cache for the next call
CACHE_CAP_BYTES = 15 * 2**20  # what one returned file may hold
QUICK_DEADLINE_S = 540


@dataclass(frozen=True)
class Step:
    """One row of the suite's table.

    ``script`` with ``args`` is started as ``python SCRIPT ARGS`` (``ranks`` 1) or under
    ``torch.distributed.run`` with ``ranks`` processes (2, or ``ALL`` GPUs); ``min_gpus`` GPUs
    must be present (0: a CPU step). ``{out}`` in an argument is the run folder. ``quick`` /
    ``full``: arguments added in that mode; ``quick_env``: environment added in ``--quick``.
    ``outputs``: the files (globs) the step leaves in the run folder, besides its log.
    ``full_only``: left out of ``--quick`` (a step that alone fills a 10-minute call).
    """

    name: str
    script: str  # a path under the repository, or "-m module" for a module
    lane: str  # "all", "gpu0", "gpu1" or "cpu"
    phase: int
    quick_s: int
    full_s: int
    min_gpus: int = 1
    ranks: int | str = 1
    args: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    full: tuple[str, ...] = ()
    quick_env: tuple[tuple[str, str], ...] = ()
    outputs: tuple[str, ...] = ()
    full_only: bool = False


_NO_TUNE = (("RELAYMOE_AUTOTUNE", "0"),)  # values and bytes, not time: one config per kernel
_E2E_SLOW = (  # --quick leaves these to the e2e step (the same run, measured) and to --full
    # (node-id prefixes: every parametrization, TE and local, of each)
    "tests/gpu/test_e2e_gpu.py::test_tiny_qwen3_ring_vs_alltoall_200_steps",
    "tests/gpu/test_e2e_gpu.py::test_checkpoint_round_trip_alltoall_ring_alltoall",
    "tests/gpu/test_e2e_gpu.py::test_checkpoint_of_the_local_impl_is_refused_by_name_under_te",
    "tests/gpu/test_e2e_gpu.py::test_fp8_recipe_trains_with_the_ring_where_alltoall_does",
    "tests/gpu/test_e2e_gpu.py::test_fused_loss_50_steps_matches_megatron",
    # 2 x 200 steps: past the quick 150 s a test under TE (1x H200, 2026-12-02)
    "tests/gpu/test_e2e_gpu.py::test_tiny_qwen3_real_data_ring_learns_as_alltoall_does",
    # a conversion and three Megatron runs per layer implementation: 160 s under TE
    "tests/gpu/test_e2e_gpu.py::test_converted_hf_checkpoint_trains_with_ring_and_alltoall",
)
_E2E = "tests/gpu/test_e2e_gpu.py::"
_FP8 = _E2E + "test_fp8_recipe_trains_with_the_ring_where_alltoall_does"
# --full runs every test of test_e2e_gpu.py (TE and local) in these groups at once
# (benchmarks/pytest_groups.py): one after another they take about 40 minutes under TE; side by
# side on 1x H100 each group took 170-540 s and all passed in one call (2026-12-07; the
# checkpoint group, 540 s with the refusal test, now leaves that test to the real-data group)
E2E_FULL_GROUPS = (
    f"{_E2E}test_tiny_qwen3_ring_vs_alltoall_200_steps",
    f"{_E2E}test_checkpoint_round_trip_alltoall_ring_alltoall",
    *(f"{_FP8}[hybrid-{r}] {_FP8}[e4m3-{r}]" for r in ("tensorwise", "delayed", "blockwise")),
    f"{_E2E}test_fused_loss_gpt_bf16_parity {_E2E}test_fused_loss_50_steps_matches_megatron "
    f"{_E2E}test_launch_runs_megatron_lm_pretrain_gpt",
    f"{_E2E}test_tiny_qwen3_real_data_ring_learns_as_alltoall_does "
    f"{_E2E}test_checkpoint_of_the_local_impl_is_refused_by_name_under_te "
    "tests/gpu/test_te_grouped_gpu.py",
    f"{_E2E}test_converted_hf_checkpoint_trains_with_ring_and_alltoall",
)
# Liger autotunes 32 configurations per GEMM kernel and 16 per weight-gradient kernel: on a cold
# Triton cache its first call alone outlasted the quick experts step (H200, 2026-11-30). Quick
# keeps relaymoe (shipped configurations) against naive; --full adds Liger and the ablations.
_QUICK_EXPERTS = ("--providers", "relaymoe_act", "naive", "relaymoe_fc1")

# bench_e2e.py's GBS_PROVIDERS (written out: the suite imports no torch)
E2E_GBS_PROVIDERS = (
    "relaymoe_ring,relaymoe_ring_graphed,mcore_alltoall_te,mcore_alltoall_te_drop,"
    "relaymoe_ring_layer_graphs"
)
# issue #49's four row providers, the graphed ring first (a budget cut loses the eager ring)
E2E_GBS_CORE = "relaymoe_ring_graphed,mcore_alltoall_te,mcore_alltoall_te_drop,relaymoe_ring"

# benchmarks/max_seq.py's TE_PROVIDERS (written out: the suite imports no torch)
MAX_SEQ_TE_PROVIDERS = (
    "mcore_alltoall_te,mcore_alltoall_te_fused_loss,relaymoe_ring_te,relaymoe_ring_te_fused_loss"
)

# Phases: 1 the untimed steps (correctness, memory) side by side, where sharing a GPU is
# harmless: the tests gate a green run, so they come first; 2 the timed 2-GPU steps alone on the
# machine (more than 2 GPUs: the ring again at EP = every GPU), most important first so that a
# late overrun costs the least; 3 the timed one-GPU steps, one lane per GPU; 4 the CPU steps on
# everything measured. Quick limits are caps, not expectations: along each phase's longest lane
# 340 + 365 + 200 + 40 s, where 2x H200 with a carried cache measured (2026-11-30) 110 (kernel
# tests 14 + memory model 43 beside dist tests 76 + timeline 34) + 172 (ring 44, e2e 111,
# ablation 17) + 18 (experts 18 beside routing 9) + ~20 s; the deadline (540 s) bounds the
# whole should a cold cache make several steps run long.
PHASES = {
    1: "untimed: tests and memory, side by side",
    2: "timed, 2 GPUs, one step at a time",
    3: "timed, 1 GPU per lane",
    4: "CPU: simulation and plots",
}


def one_gpu_e2e(name: str, *args: str) -> Step:
    """A ``--full`` step of ``bench_e2e.py`` on GPU 0 alone that fills one device call: ``args``
    (shapes, providers, steps, ...), 530 s of budget, its rows in ``{out}/<name>.jsonl``."""
    return Step(name, "benchmarks/bench_e2e.py", "gpu0", 3, 0, 560, full_only=True,
                args=(*args, "--gpus", "1", "--budget-s", "530", "--out", f"{{out}}/{name}.jsonl"),
                outputs=(f"{name}.jsonl",))  # fmt: skip


STEPS: tuple[Step, ...] = (
    Step("gpu_tests_kernels", "-m pytest", "gpu0", 1, 160, 400,
         args=("-q", "-ra", "-p", "no:cacheprovider", "tests/gpu/test_kernels_gpu.py",
               "tests/gpu/test_loss_gpu.py", "tests/gpu/test_large_offsets_gpu.py",
               "tests/gpu/test_main_grads_gpu.py", "tests/gpu/test_hop_slices_gpu.py",
               "--junitxml={out}/gpu_tests_kernels.xml"),
         quick=("--timeout", "60"), full=("--timeout", "300"), quick_env=_NO_TUNE,
         outputs=("gpu_tests_kernels.xml",)),
    # The remaining GPU test files, in three --full steps that each fit one device call (cold
    # Triton cache; 1x H100, 2026-12-07, every file together took over 20 minutes). The bf16
    # GPU tests of every activation and bias, the Gluon gather kernels, the recorded hops and
    # the fp8 experts: --only gpu_tests_ops
    Step("gpu_tests_ops", "-m pytest", "gpu0", 1, 0, 580, full_only=True,
         args=("-q", "-ra", "-p", "no:cacheprovider", "tests/gpu/test_activations_gpu.py",
               "tests/gpu/test_gather_ws_gpu.py", "tests/gpu/test_hop_graphs_gpu.py",
               "tests/gpu/test_fp8_experts_gpu.py", "tests/gpu/test_ring_fp8_gpu.py",
               "--junitxml={out}/gpu_tests_ops.xml"),
         full=("--timeout", "300"), outputs=("gpu_tests_ops.xml",)),
    # the property sweep: compile-bound on a cold cache (each case's dtypes, layouts and sizes
    # of 1 are new specializations: 2-50 s a case at first), so alone: --only gpu_tests_property
    Step("gpu_tests_property", "-m pytest", "gpu0", 1, 0, 580, full_only=True,
         args=("-q", "-ra", "-p", "no:cacheprovider", "tests/gpu/test_property_gpu.py",
               "--junitxml={out}/gpu_tests_property.xml"),
         full=("--timeout", "300"), outputs=("gpu_tests_property.xml",)),
    # megatron-core's own MoE-layer tests with the ring (.megatron_lm/ carried), the captured
    # layers and max_seq's TE trials (tiny Megatron runs; with TE, megatron-core's tests, the TE
    # capture case and max_seq's took under 390 s together on 1x H100, 2026-12-07): --only
    # gpu_tests_megatron
    Step("gpu_tests_megatron", "-m pytest", "gpu0", 1, 0, 580, full_only=True,
         args=("-q", "-ra", "-p", "no:cacheprovider", "tests/gpu/test_mcore_moe_layer_gpu.py",
               "tests/gpu/test_capture_gpu.py", "tests/gpu/test_max_seq_gpu.py",
               "--junitxml={out}/gpu_tests_megatron.xml"),
         full=("--timeout", "300"), outputs=("gpu_tests_megatron.xml",)),
    Step("memory_model", "benchmarks/validate_memory_model.py", "gpu0", 1, 100, 300,
         args=("--out", "{out}/memory_model.jsonl"), quick=("--quick",), quick_env=_NO_TUNE,
         outputs=("memory_model.jsonl",)),
    Step("gpu_tests_dist", "-m pytest", ALL, 1, 160, 400, min_gpus=2,
         args=("-q", "-ra", "-p", "no:cacheprovider", "tests/gpu/test_ring_gpu.py",
               "--junitxml={out}/gpu_tests_dist.xml"),
         quick=("--timeout", "100"), full=("--timeout", "380"), quick_env=_NO_TUNE,
         outputs=("gpu_tests_dist.xml",)),
    # Megatron training on 1 or 2 GPUs (EP = GPUs), with TE (where it imports) and with the local
    # layers, and the te_grouped provider against the oracle. Quick: 280 s, since with TE each
    # Megatron run starts in ~40 s and the quick items make about six runs
    Step("gpu_tests_e2e", "benchmarks/pytest_groups.py", ALL, 1, 280, 575,
         args=("--out", "{out}/gpu_tests_e2e_"),
         quick=("--group", " ".join(("tests/gpu/test_e2e_gpu.py",
                                     "tests/gpu/test_te_grouped_gpu.py", "--timeout", "150",
                                     *(a for t in _E2E_SLOW for a in ("--deselect", t))))),
         full=tuple(a for g in E2E_FULL_GROUPS for a in ("--group", f"{g} --timeout 520")),
         quick_env=_NO_TUNE, outputs=("gpu_tests_e2e_*",)),
    Step("memory_timeline", "benchmarks/memory_timeline.py", ALL, 1, 60, 120, ranks=2,
         args=("--out", "{out}/memory_timeline.jsonl"), quick=("--quick",), quick_env=_NO_TUNE,
         outputs=("memory_timeline.jsonl", "memory_timeline*.png")),
    Step("ring", "benchmarks/bench_ring.py", ALL, 2, 150, 540, min_gpus=2, ranks=2,
         args=("--out", "{out}/ring.jsonl"), quick=("--quick",), full=("--seq", "--crossover"),
         outputs=("ring.jsonl",)),
    Step("ring_wide", "benchmarks/bench_ring.py", ALL, 2, 120, 540, min_gpus=3, ranks=ALL,
         args=("--no-crossover", "--out", "{out}/ring_wide.jsonl"), quick=("--quick",),
         full=("--seq",), outputs=("ring_wide.jsonl",)),
    Step("e2e", "benchmarks/bench_e2e.py", ALL, 2, 170, 540, min_gpus=2,
         args=("--out", "{out}/e2e.jsonl"), quick=("--quick",), outputs=("e2e.jsonl",)),
    Step("ablation", "benchmarks/ablation.py", ALL, 2, 45, 300, min_gpus=2, ranks=2,
         args=("--out", "{out}/ablation.jsonl"), quick=("--quick",),
         outputs=("ablation.jsonl",)),
    # issue #17 on 2 GPUs, --full only (each fills most of a call: run them with --only):
    # a dead or stalled peer under NCCL, both transports and modes; the routing-drift soak;
    # Megatron's 1F1B and interleaved schedules at PP=2 against alltoall. Faults with the host
    # waits that name a dead peer under NCCL (RELAYMOE_RING_HOST_WAIT pass and lag; the default
    # "off" leaves a hang to NCCL's watchdog), and what each costs a Megatron run
    Step("fault_nccl", "benchmarks/fault.py", ALL, 2, 0, 540, min_gpus=2, full_only=True,
         args=("--backend", "nccl", "--world", "2", "--timeout", "10", "--concurrency", "6",
               "--host-wait", "pass,lag", "--out", "{out}/fault.jsonl"),
         outputs=("fault.jsonl",)),
    Step("host_wait", "benchmarks/host_wait_cost.py", ALL, 2, 0, 540, min_gpus=2,
         full_only=True, args=("--values", "off,lag,pass", "--run-timeout-s", "90", "--out",
                               "{out}/host_wait.jsonl"), outputs=("host_wait.jsonl",)),
    Step("determinism", "benchmarks/determinism.py", ALL, 2, 0, 300, min_gpus=2,
         full_only=True, args=("--parallel", "4", "--out", "{out}/determinism.jsonl"),
         outputs=("determinism.jsonl",)),
    Step("soak", "benchmarks/soak.py", ALL, 2, 0, 580, min_gpus=2, full_only=True,
         args=("--run-timeout-s", "420", "--parallel", "--out", "{out}/soak.jsonl"),
         outputs=("soak.jsonl",)),
    Step("e2e_pp", "benchmarks/bench_e2e.py", ALL, 2, 0, 540, min_gpus=2, full_only=True,
         args=("--shapes", "tiny_qwen3_pp2,tiny_qwen3_pp2_vpp2", "--noise-run", "--out",
               "{out}/e2e_pp.jsonl"), outputs=("e2e_pp.jsonl",)),
    # issue #49 on one GPU: the qwen3 slice at global batch 16 (16 micro-batches a step), each of
    # the five providers once, one profiled step a run (gpu_busy_frac); about 400 s on 1x H100
    # by estimate (five Megatron start-ups of ~40 s, 15 steps of 1-3 s): --full, or
    # --only e2e_gbs16 (one call, handed back as one archive with --handoff)
    one_gpu_e2e("e2e_gbs16", "--shapes", "qwen3_slice_s4k_gbs16_te", "--providers",
                E2E_GBS_PROVIDERS, "--steps", "15", "--profile-busy"),
    # the anchor at its best at global batch 16: its run as kept, with Megatron's weight-gradient
    # fusion off (TE's GroupedLinear then runs grouped GEMMs instead of one accumulating GEMM an
    # expert), with attention graphs only, and again (the drift): four runs, --only
    # e2e_sweep_gbs16
    one_gpu_e2e("e2e_sweep_gbs16", "--shapes", "qwen3_slice_s4k_gbs16_te", "--anchor-sweep",
                "--sweep-candidates", "no_wgrad_fusion", "cuda_graph_attn", "--steps", "12"),
    # the other gradient-accumulation shapes of issue #49, four providers each, one call each:
    # --only e2e_gbs64, --only e2e_s16k_gbs8
    one_gpu_e2e("e2e_gbs64", "--shapes", "qwen3_slice_s4k_gbs64_te", "--providers", E2E_GBS_CORE,
                "--steps", "12", "--profile-busy"),
    one_gpu_e2e("e2e_s16k_gbs8", "--shapes", "qwen3_slice_s16k_gbs8_te", "--providers",
                E2E_GBS_CORE, "--steps", "12", "--profile-busy"),
    # issue #49's loss parity: the graphed ring and the anchor over 50 steps at global batch 16,
    # the anchor once more with its first run's flags (its same-seed noise, the parity bound),
    # and the batch-1 rows of the graphed ring beside the anchor: --only e2e_parity_gbs16,
    # --only e2e_graphed_gbs1
    one_gpu_e2e("e2e_parity_gbs16", "--shapes", "qwen3_slice_s4k_gbs16_te", "--providers",
                "relaymoe_ring_graphed,mcore_alltoall_te", "--noise-run", "--steps", "50"),
    one_gpu_e2e("e2e_graphed_gbs1", "--shapes", "qwen3_slice_s4k_te", "--providers",
                "relaymoe_ring_graphed,mcore_alltoall_te,relaymoe_ring", "--steps", "30",
                "--profile-busy"),
    # the same without TE (megatron-core's local layers; its alltoall without TE's fusions):
    # four runs, about 300 s on 1x H100 by estimate: --full, or --only e2e_gbs16_local
    one_gpu_e2e("e2e_gbs16_local", "--shapes", "qwen3_slice_s4k_gbs16", "--steps", "15",
                "--profile-busy"),
    # issue #53: the longest sequence at EP 1 under TransformerEngine, the four providers
    # (MAX_SEQ_TE_PROVIDERS) x the recompute policies full, selective, none, each trial capped at
    # an H100 80GB's usable bytes (--memory-cap h100-80gb: the planner's 74.2 GiB, the same rows
    # on an H100 or an H200). One job (provider x policy) per GPU at a time (--lanes all): on 8
    # GPUs one call (12 searches of at most 180 s, eight at once, the anchors first, then the
    # timed trials at the anchors' lengths; --budget-s 540). On fewer GPUs split the jobs over
    # calls with --extra max_seq_te='--policies P --providers ...' (benchmarks/README.md).
    # --full, or --full --only max_seq_te
    Step("max_seq_te", "benchmarks/max_seq.py", ALL, 2, 0, 580, full_only=True,
         args=("--providers", MAX_SEQ_TE_PROVIDERS, "--policies", "full,selective,none",
               "--gpus", "1", "--lanes", "all", "--memory-cap", "h100-80gb", "--growth", "0.03",
               "--budget-s", "540", "--search-budget-s", "180", "--max-trial-s", "170",
               "--min-trial-s", "45", "--anchor-rows", "{out}/max_seq_te.jsonl",
               "--out", "{out}/max_seq_te.jsonl"),
         outputs=("max_seq_te.jsonl",)),
    Step("routing", "benchmarks/bench_routing.py", "gpu0", 3, 25, 240,
         args=("--rep-ms", "50", "--out", "{out}/routing.jsonl"), quick=("--quick",),
         outputs=("routing.jsonl",)),
    Step("experts", "benchmarks/bench_experts.py", "gpu1", 3, 200, 420,
         args=("--out", "{out}/experts.jsonl", "--first-call"), quick=("--quick", *_QUICK_EXPERTS),
         outputs=("experts.jsonl",)),
    # calibrated on the CURRENT runs' rows and this run's, which replace the same measurements
    Step("scaling_sim", "benchmarks/scaling_sim.py", "cpu", 4, 20, 60, min_gpus=0,
         args=("--out", "{out}/scaling_sim.jsonl", "--rows", "{out}/*.jsonl"),
         quick=("--quick",), outputs=("scaling_sim.jsonl",)),
    Step("plots", "benchmarks/plots.py", "cpu", 4, 20, 60, min_gpus=0,
         args=("--results", "{out}", "--out", "{out}"), outputs=("*.png",)),
)  # fmt: skip


# ---------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class Planned:
    """A step as it will run on this machine: its command and environment, or why not."""

    step: Step
    command: tuple[str, ...]
    env: dict
    limit_s: int
    lane: str  # resolved: "all", "cpu" or "gpuN"
    skip: str | None = None


def plan(
    steps: Sequence[Step],
    *,
    gpus: int,
    quick: bool,
    out: Path,
    python: str = sys.executable,
    only: Sequence[str] = (),
    root: Path = ROOT,
    limits: dict[str, int] | None = None,
    extra: dict[str, tuple[str, ...]] | None = None,
) -> list[Planned]:
    """Every step of ``steps`` in run order (phase, then table order), resolved for a machine of
    ``gpus`` GPUs. ``only``: run just these (the others are left out, not skipped).
    ``limits``: per-step overrides of the mode's limit; ``extra``: per-step added arguments."""
    names = {s.name for s in steps}
    for what, given in (("--only", only), ("--limit", limits or {}), ("--extra", extra or {})):
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(
                f"{what} names unknown step(s) {unknown}; known: {', '.join(sorted(names))}"
            )
    out_s = str(out)
    chosen = [s for s in steps if (not only or s.name in only) and not (quick and s.full_only)]
    result = []
    for s in sorted(chosen, key=lambda s: s.phase):  # stable: table order within a phase
        mode_args = s.quick if quick else s.full
        args = [a.replace("{out}", out_s) for a in (*s.args, *mode_args)]
        args += (extra or {}).get(s.name, ())
        ranks = gpus if s.ranks == ALL else min(int(s.ranks), max(gpus, 1))
        if s.script.startswith("-m "):
            cmd = [python, *s.script.split()]
        elif ranks >= 2:
            cmd = [python, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(ranks), s.script]  # fmt: skip
        else:
            cmd = [python, s.script]
        lane = s.lane
        if lane.startswith("gpu") and gpus < 2:
            lane = "gpu0"  # one GPU: both lanes are GPU 0, one after the other
        env = dict(s.quick_env) if quick else {}
        if lane.startswith("gpu"):
            env["CUDA_VISIBLE_DEVICES"] = lane[3:]
        skip = None
        if gpus < s.min_gpus:
            skip = f"needs {s.min_gpus} GPU{'s' * (s.min_gpus > 1)}, found {gpus}"
        elif not s.script.startswith("-m ") and not (root / s.script).is_file():
            skip = f"{s.script} not present"
        limit = (limits or {}).get(s.name, s.quick_s if quick else s.full_s)
        result.append(Planned(s, (*cmd, *args), env, int(limit), lane, skip))
    return result


def adhoc_steps(specs: Sequence[str], *, limit_s: int = QUICK_DEADLINE_S) -> tuple[Step, ...]:
    """``--step NAME=COMMAND`` items as steps of one lane (GPU 0, or the CPU where there is no
    GPU: ``min_gpus`` 0), in the order given; each owns the run folder's files ``NAME*``."""
    steps: list[Step] = []
    for item in specs:
        name, sep, command = item.partition("=")
        words = shlex.split(command)
        if not sep or not name.isidentifier() or not words or words == ["-m"]:
            raise ValueError(
                f"--step {item!r}: use NAME=COMMAND with NAME a word and COMMAND a script or "
                "'-m module' and its arguments, e.g. --step sweep='benchmarks/lab/sweep_kernels.py "
                "--out {out}/sweep.jsonl'"
            )
        if any(s.name == name for s in steps):
            raise ValueError(f"--step {name!r} is given twice; each step needs its own name")
        if words[0] == "-m":
            script, args = f"-m {words[1]}", words[2:]
        else:
            script, args = words[0], words[1:]
        steps.append(Step(name, script, "gpu0", 3, limit_s, limit_s, min_gpus=0,
                          args=tuple(args), outputs=(f"{name}*",)))  # fmt: skip
    return tuple(steps)


def describe(planned: Sequence[Planned], *, deadline_s: float | None) -> str:
    """The plan as text (``--dry-run``)."""
    lines = [
        f"deadline {deadline_s:.0f} s for the whole suite" if deadline_s else "no suite deadline"
    ]
    phase = None
    for p in planned:
        if p.step.phase != phase:
            phase = p.step.phase
            lanes = sorted({q.lane for q in planned if q.step.phase == phase})
            lines.append(f"phase {phase}: {PHASES.get(phase, '')} (lanes {', '.join(lanes)})")
        env = " ".join(f"{k}={v}" for k, v in sorted(p.env.items()))
        what = f"SKIP ({p.skip})" if p.skip else f"limit {p.limit_s:>4} s"
        lines.append(f"  [{p.lane:>4}] {p.step.name:<18} {what}")
        if not p.skip:
            lines.append(f"         {env + ' ' if env else ''}{shlex.join(p.command)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- running
@dataclass
class Outcome:
    name: str
    status: str  # runs.STATUSES
    seconds: float
    command: str
    limit_s: int
    rc: int | None = None
    reason: str | None = None
    files: list[str] = field(default_factory=list)

    def record(self) -> dict:
        d = {
            "name": self.name,
            "status": self.status,
            "seconds": round(self.seconds, 1),
            "files": self.files,
            "command": self.command,
            "limit_s": self.limit_s,
        }
        if self.rc is not None:
            d["rc"] = self.rc
        if self.reason:
            d["reason"] = self.reason
        return d


def run_command(
    cmd: Sequence[str], *, env: dict, limit_s: float, log: Path, cwd: Path
) -> tuple[str, int | None, float]:
    """Run ``cmd`` in its own process group with output to ``log``; when it outlives ``limit_s``
    stop its group and every process it started, in its group or not (a test's Megatron job,
    torchrun's workers: SIGTERM, SIGKILL after ``KILL_GRACE_S``). (status, rc, seconds)."""
    t0 = time.monotonic()
    with open(log, "wb") as f:
        try:
            proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=env,
                                    cwd=cwd, start_new_session=True)  # fmt: skip
        except OSError as e:  # e.g. the interpreter is missing
            f.write(f"could not start {cmd[0]}: {e}\n".encode())
            return "failed", None, time.monotonic() - t0
        try:
            rc = proc.wait(timeout=max(limit_s, 0.1))
        except subprocess.TimeoutExpired:
            stop_tree(proc, KILL_GRACE_S)
            f.write(f"\n[suite] killed after the step's limit of {limit_s:.0f} s\n".encode())
            return "timeout", proc.returncode, time.monotonic() - t0
    return ("ok" if rc == 0 else "failed"), rc, time.monotonic() - t0


class Suite:
    """Runs a plan phase by phase, lanes in threads, into ``out`` with a manifest."""

    def __init__(
        self,
        planned: Sequence[Planned],
        *,
        out: Path,
        manifest: dict,
        base_env: dict,
        deadline_s: float | None,
        cwd: Path = ROOT,
        clock: Callable[[], float] = time.monotonic,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.planned, self.out, self.manifest = list(planned), Path(out), manifest
        self.base_env, self.deadline_s, self.cwd = base_env, deadline_s, cwd
        self.clock, self.echo = clock, echo
        self.t0 = clock()
        self.lock = threading.Lock()
        self.outcomes: dict[str, Outcome] = {}

    def log(self, msg: str) -> None:
        with self.lock:
            self.echo(f"[suite +{self.clock() - self.t0:5.0f}s] {msg}")

    def run(self) -> list[Outcome]:
        self.out.mkdir(parents=True, exist_ok=True)
        self._write_manifest()
        phases = sorted({p.step.phase for p in self.planned})
        for ph in phases:
            lanes: dict[str, list[Planned]] = {}
            for p in self.planned:
                if p.step.phase == ph:
                    lanes.setdefault(p.lane, []).append(p)
            threads = [
                threading.Thread(target=self._lane, args=(steps,), name=f"lane-{lane}")
                for lane, steps in lanes.items()
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return [self.outcomes[p.step.name] for p in self.planned]

    def _lane(self, steps: list[Planned]) -> None:
        for p in steps:
            self._finish(self._one(p))

    def _one(self, p: Planned) -> Outcome:
        cmd = shlex.join(p.command)
        if p.skip:
            self.log(f"SKIP {p.step.name}: {p.skip}")
            return Outcome(p.step.name, "skipped", 0.0, cmd, p.limit_s, reason=p.skip)
        limit = float(p.limit_s)
        if self.deadline_s is not None:
            reserve = RESERVE_S if p.step.min_gpus else RESERVE_S // 3  # CPU steps are last
            left = self.deadline_s - (self.clock() - self.t0) - reserve
            if left < MIN_STEP_S:
                why = f"suite deadline {self.deadline_s:.0f} s reached"
                self.log(f"SKIP {p.step.name}: {why}")
                return Outcome(p.step.name, "skipped", 0.0, cmd, p.limit_s, reason=why)
            limit = min(limit, left)
        env = {**self.base_env, **p.env}
        self.log(f"START {p.step.name} (limit {limit:.0f} s): {cmd}")
        log = self.out / f"{p.step.name}.log"
        status, rc, secs = run_command(p.command, env=env, limit_s=limit, log=log, cwd=self.cwd)
        tail = log.read_text(errors="replace").splitlines()[-15:]
        with self.lock:
            for ln in tail:
                self.echo(f"    [{p.step.name}] {ln}")
        self.log(f"{status.upper()} {p.step.name} rc={rc} in {secs:.0f} s")
        files = sorted({f.name for pat in (*p.step.outputs, log.name) for f in self.out.glob(pat)})
        return Outcome(p.step.name, status, secs, cmd, int(limit), rc=rc, files=files)

    def _finish(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes[o.name] = o
            self._write_manifest()

    def _write_manifest(self) -> None:
        order = [p.step.name for p in self.planned]
        done = [self.outcomes[n].record() for n in order if n in self.outcomes]
        self.manifest["steps"] = done
        self.manifest["seconds"] = round(self.clock() - self.t0, 1)
        runs.write_manifest(self.out, self.manifest)


# ------------------------------------------------------------------------- machine and tree
def detect_gpus() -> tuple[int, str]:
    """(count, name) of the NVIDIA GPUs from ``nvidia-smi``; (0, "cpu") without one."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return 0, "cpu"
    names = [n.strip() for n in r.stdout.splitlines() if n.strip()] if r.returncode == 0 else []
    return (len(names), names[0]) if names else (0, "cpu")


def tree_state(root: Path = ROOT) -> tuple[str, bool | str, str]:
    """(commit, tree_clean, where they came from): git, else ``RELAYMOE_COMMIT`` /
    ``.relaymoe_commit`` with ``RELAYMOE_TREE_CLEAN=1`` as the caller's statement.

    A ``RELAYMOE_COMMIT`` that git's commit does not start with wins over git, with
    ``RELAYMOE_TREE_CLEAN=1`` as above: the device machine holds a git checkout of the
    session's first commit under the tree it was sent, so its git names that commit and
    calls the sent tree dirty."""
    commit, clean = runs.git_state(root)
    env = os.environ.get("RELAYMOE_COMMIT", "").strip()
    if env and not re.fullmatch(r"[0-9a-f]{12,40}", env):
        raise ValueError(
            f"RELAYMOE_COMMIT={env!r}: the run folder and every row name the commit by at least "
            "12 hex digits; fix: RELAYMOE_COMMIT=$(git rev-parse HEAD | cut -c1-12)"
        )
    if commit != runs.UNKNOWN and not (env and not commit.startswith(env[: len(commit)])):
        return commit, clean, "git"
    stale = f"; git there named {commit} (clean: {clean})" if commit != runs.UNKNOWN else ""
    marker = root / ".relaymoe_commit"
    commit = env or (marker.read_text().strip() if marker.is_file() else "")
    if not commit:
        return runs.UNKNOWN, runs.UNKNOWN, "no git checkout and no RELAYMOE_COMMIT"
    if os.environ.get("RELAYMOE_TREE_CLEAN") == "1":
        return (
            commit,
            True,
            (f"RELAYMOE_COMMIT; RELAYMOE_TREE_CLEAN=1 (the tree is that commit){stale}"),
        )
    return commit, runs.UNKNOWN, f"RELAYMOE_COMMIT (no git checkout to check the tree){stale}"


def make_manifest(command: str, gpu: str, gpus: int, root: Path = ROOT) -> dict:
    m = runs.new_manifest(command=command, gpu=gpu, gpus=max(gpus, 1), root=root)
    commit, clean, source = tree_state(root)
    m.update(commit=commit, tree_clean=clean, tree_source=source)
    try:
        m["name"] = runs.run_name(m["date"], gpu, max(gpus, 1), commit)
    except runs.ResultsError:
        m["name"] = f"{m['date']}_{runs.gpu_slug(gpu)}x{max(gpus, 1)}_{runs.UNKNOWN}"
    return m


def child_env(root: Path, commit: str, site: Path | None) -> dict:
    """The steps' environment: never NVLink multicast (the lent machines), Triton compiling for
    the GPU, the cache with its autotuning results, this checkout importable."""
    env = dict(os.environ)
    path = [str(root)] + ([str(site)] if site else [])
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        TRITON_INTERPRET="0",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(path),
        TRITON_CACHE_AUTOTUNING="1",
    )
    env.setdefault("OMP_NUM_THREADS", "4")
    env.setdefault("TRITON_CACHE_DIR", "/tmp/relaymoe_triton_cache")
    if commit != runs.UNKNOWN:
        env["RELAYMOE_COMMIT"] = commit  # the rows carry it
    if "MEGATRON_LM_DIR" not in env and (root / ".megatron_lm" / "pretrain_gpt.py").is_file():
        env["MEGATRON_LM_DIR"] = str(root / ".megatron_lm")  # the launch test
    return env


def install_wheels(root: Path, log: Path) -> Path | None:
    """Carried wheels (``.whl/*.whl``: megatron-core, liger-kernel) into /tmp/site, offline."""
    wheels = sorted((root / ".whl").glob("*.whl"))
    if not wheels:
        return None
    site = Path("/tmp/site")
    # a wheel's file name begins with its dist-info's: when all are there (device_run.sh put them,
    # or a suite started beside this one), re-installing would swap modules under running steps
    have = {d.name.removesuffix(".dist-info") for d in site.glob("*.dist-info")}
    if all("-".join(w.name.split("-")[:2]) in have for w in wheels):
        print(f"[suite] {len(wheels)} carried wheels already in {site}")
        return site
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--target", str(site), *map(str, wheels)]  # fmt: skip
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"[suite] {len(wheels)} carried wheels into {site}: rc={rc} (log {log.name})")
    return site


def record_versions(manifest: dict, site: Path) -> None:
    """The manifest's versions read again with ``site`` searched: the carried wheels (megatron-core
    above all) are installed after the manifest is made, into a folder this process did not
    search, so without this their versions read ``unknown``. First on the path, as in the steps'
    ``PYTHONPATH``: a carried wheel is what the steps import."""
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    vers = runs.versions()
    manifest.update(versions=vers, transformer_impl=runs.transformer_impl(vers),
                    te_version=vers.get("transformer-engine"))  # fmt: skip


def seed_triton_cache(root: Path, cache_dir: Path) -> None:
    src = root / ".triton_cache.tar.gz"
    cache_dir.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        with tarfile.open(src) as t:
            t.extractall(cache_dir, filter="data")
        print(f"[suite] Triton cache seeded from {src.name} (autotuning results included)")


def pack_triton_cache(cache_dir: Path, dest: Path, cap: int = CACHE_CAP_BYTES) -> None:
    """The cache for the next call, under what one returned file may hold: whole if it fits,
    else only the autotuning results (the next call compiles but does not re-tune). ``tar`` with
    multi-threaded xz: Python's lzma would spend minutes of the call on a large cache."""
    files = sorted(str(p.relative_to(cache_dir)) for p in cache_dir.rglob("*") if p.is_file())
    tuned = [f for f in files if f.endswith(".autotune.json")]
    raw = sum((cache_dir / f).stat().st_size for f in files)
    subsets = ([files] if raw <= 8 * cap else []) + [tuned]  # xz shrinks kernels ~5x at best
    env = dict(os.environ, XZ_OPT="-T0")
    for subset in subsets:
        if not subset:
            continue
        listing = dest.with_suffix(".list")
        listing.write_text("\n".join(subset) + "\n")
        r = subprocess.run(["tar", "-cJf", str(dest), "-C", str(cache_dir), "-T", str(listing)],
                           env=env, capture_output=True)  # fmt: skip
        listing.unlink()
        if r.returncode == 0 and dest.stat().st_size <= cap:
            print(f"[suite] Triton cache for the next call: {len(subset)} files, "
                  f"{dest.stat().st_size / 2**20:.1f} MiB")  # fmt: skip
            return
    dest.unlink(missing_ok=True)
    print("[suite] no Triton cache returned: it does not fit one file even without kernels")


def handoff(run_dir: Path, dest: Path, cache_dir: Path) -> None:
    """``suite.tar.gz`` (the run folder, to unpack under benchmarks/results/), manifest.json and
    the Triton cache into ``dest``: the device tool returns a few files, not a tree."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest / "suite.tar.gz", "w:gz") as t:
        t.add(run_dir, arcname=run_dir.name)
    shutil.copy(run_dir / runs.MANIFEST, dest / runs.MANIFEST)
    pack_triton_cache(cache_dir, dest / "triton_cache.tar.gz")


# -------------------------------------------------------------------------------------- main
def summary(outcomes: Sequence[Outcome]) -> str:
    lines = [f"    {o.name:<18} {o.status:<8} {o.seconds:6.0f} s  {o.reason or ''}"
             for o in outcomes]  # fmt: skip
    bad = [o.name for o in outcomes if o.status in ("failed", "timeout")]
    lines.append(f"    failed: {', '.join(bad) or 'none'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, steps: Sequence[Step] = STEPS) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: one 10-minute call")
    mode.add_argument("--full", action="store_true", help="larger sweeps, longer limits")
    ap.add_argument("--only", default="", help="comma-separated step names")
    ap.add_argument("--gpus", type=int, default=None, help="default: nvidia-smi's count")
    ap.add_argument("--out", default=None, help="the run folder (default: the run's own name "
                    "under benchmarks/results/)")  # fmt: skip
    ap.add_argument("--handoff", default=None, help="scratch run folder; bundles into this dir")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help=f"whole-suite bound (--quick default {QUICK_DEADLINE_S}; 0: none)",
    )
    ap.add_argument("--limit", action="append", default=[], metavar="STEP=S",
                    help="override a step's limit (repeatable)")  # fmt: skip
    ap.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="STEP=ARGS",
        help="more arguments for a step, e.g. experts='--shapes qwen3_30b_a3b_T64k'",
    )
    ap.add_argument(
        "--step",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="an ad hoc step in place of the table (repeatable, run in order on GPU 0): a script "
        "or '-m module' and its arguments, '{out}' the run folder, files NAME* the step's",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    a = ap.parse_args(argv)
    if a.step:
        try:
            steps = adhoc_steps(a.step)
        except ValueError as e:
            ap.error(str(e))
    quick = not a.full
    deadline = a.deadline_s if a.deadline_s is not None else (QUICK_DEADLINE_S if quick else 0)
    limits = {}
    for item in a.limit:
        name, _, secs = item.partition("=")
        if not secs.isdigit():
            ap.error(f"--limit {item!r}: use STEP=SECONDS, e.g. --limit experts=300")
        limits[name] = int(secs)
    extra = {}
    for item in a.extra:
        name, _, more = item.partition("=")
        extra[name] = tuple(shlex.split(more))
    only = [s for s in a.only.split(",") if s]
    ngpu, gpu = detect_gpus()
    if a.gpus is not None:
        ngpu = a.gpus
    elif a.dry_run and ngpu == 0:
        ngpu, gpu = 2, "planned"
        print("[suite] no GPU here: the plan of a 2-GPU machine (--gpus N for another)")
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "-m", "benchmarks.suite", *given])
    manifest = make_manifest(command, gpu, ngpu, root=ROOT)
    if a.out:
        out = Path(a.out).resolve()
    elif a.handoff:
        out = Path("/tmp/relaymoe_suite") / manifest["name"]
    else:
        out = runs.RESULTS / manifest["name"]
    try:
        planned = plan(steps, gpus=ngpu, quick=quick, out=out, only=only, limits=limits,
                       extra=extra, root=ROOT)  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    print(f"[suite] {'quick' if quick else 'full'}: {ngpu} x {gpu}, commit {manifest['commit']} "
          f"(tree clean: {manifest['tree_clean']}), run folder {out}")  # fmt: skip
    if a.dry_run:
        print(describe(planned, deadline_s=deadline or None))
        return 0
    if a.handoff and out.exists():
        shutil.rmtree(out)  # a host reused between calls once kept an older call's rows
    out.mkdir(parents=True, exist_ok=True)
    site = install_wheels(ROOT, out / "pip_install.log")
    if site is not None:
        record_versions(manifest, site)
    print("[suite] versions: " + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items()))
    env = child_env(ROOT, manifest["commit"], site)
    cache = Path(env["TRITON_CACHE_DIR"])
    seed_triton_cache(ROOT, cache)
    manifest["started"] = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    suite = Suite(planned, out=out, manifest=manifest, base_env=env, deadline_s=deadline or None,
                  cwd=ROOT)  # fmt: skip
    outcomes = suite.run()
    print(f"[suite] done in {suite.clock() - suite.t0:.0f} s; manifest {out / runs.MANIFEST}")
    print(summary(outcomes))
    if a.handoff:
        handoff(out, Path(a.handoff), cache)
    print(json.dumps({"run": manifest["name"], "folder": str(out)}))
    return 1 if any(o.status in ("failed", "timeout") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
