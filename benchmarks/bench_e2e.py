"""End-to-end: Megatron training with the ring and with megatron-core's alltoall, same seed.

    python benchmarks/bench_e2e.py [--steps 200] [--gpus 2] [--config tiny_qwen3]     # default
    python benchmarks/bench_e2e.py --shapes qwen3_slice_s4k,qwen3_slice_s16k --noise-run \\
        [--steps 50] [--budget-s 520]                                            # 2 GPUs, EP=2

Every run is one ``torchrun -m relaymoe.megatron.pretrain`` job on mock data (see
``benchmarks/e2e.py``), one after another in this invocation, its wall time printed as it
ends. Per shape: ``ring`` (provider ``relaymoe_ring``: ``--moe-token-dispatcher-type ring``,
ring mode auto), ``alltoall`` (``mcore_alltoall``) and, with ``--noise-run``, ``alltoall_repeat``:
alltoall again with identical flags and seed, whose distance to the first alltoall run is
megatron-core's own run-to-run noise. The flags differ between ring and alltoall only in the
dispatcher.

Default (no ``--shapes``): ``configs/tiny_qwen3.yaml`` (or ``--config``), 200 steps, regime
``launcher``; rows ``shape: <config>_steps<steps>`` (what ``scripts/gpu_suite.sh`` runs,
``--quick``). Must finish in < 3 minutes on 2 GPUs.

Shapes (``--shapes``): the qwen3 slice, ``configs/qwen3_slice.yaml`` (4 layers of Qwen3-30B-A3B:
hidden 2048, 128 experts top-8, expert FFN 768, 32 heads in 4 query groups of 128, qk-layernorm,
vocabulary 32768, every layer MoE, bf16) at EP = GPUs:

    qwen3_slice_s4k    sequence 4096, micro-batch 1
    qwen3_slice_s16k   sequence 16384, micro-batch 1, selective recompute of core_attn
    tiny_qwen3_pp2     configs/tiny_qwen3.yaml at PP=2, EP=1 on 2 GPUs (global batch 2 = two
                       micro-batches through Megatron's 1F1B schedule; issue #17)
    tiny_qwen3_pp2_vpp2
                       the same with two virtual stages per rank (interleaved 1F1B)
    tiny_qwen3_gelu    configs/tiny_qwen3_gelu.yaml: tiny_qwen3 with GELU experts (megatron-core's
                       default MLP, not gated; issue #36), its sequence 512 and micro-batch 4
    tiny_qwen3_squared_relu
                       the same with squared-ReLU experts (--squared-relu)
    qwen3_slice_v152k_s4k_fused_loss
                       configs/qwen3_slice_v152k.yaml (the slice with Qwen3's 151,936-token
                       vocabulary, full recompute), sequence 4096, micro-batch 1; the ring run
                       adds --relaymoe-fused-loss (row field fused_loss), the alltoall runs are
                       Megatron's own output layer + vocab-parallel cross-entropy

Global batch = micro-batch x data-parallel size (= GPUs; no gradient accumulation), 50 steps,
seed 1234. s16k recomputes the attention core: without TransformerEngine megatron-core's local
attention materialises a layer's 32 x 16k x 16k bf16 scores (16 GiB) and keeps its softmax for
the backward; by estimate ~145 GiB a rank without the recompute (4 x 16 kept, a 16 GiB score
buffer, 2 x 16 in the backward, ~23 GiB of weights and optimizer state), ~110 GiB with it.

Training regime of the shapes, ``stable`` (``benchmarks.e2e.REGIMES``): lr 1e-4 after 10
linear warm-up iterations, cosine to 1e-5 over the run, gradient clipping 1.0, weight decay
0.01, Adam betas (0.9, 0.95), init std 0.02. The launcher's own regime (lr 3e-4 after
max(1, steps // 20) warm-up iterations, Adam beta2 0.999) let two alltoall runs with one seed
drift 0.46 apart in loss within 30 steps, ring vs alltoall up to 1.95 (commit 1991b42).
``--regime`` overrides a shape's regime.

Rows ``bench: e2e`` appended to ``--out`` after each shape's runs: ``provider`` in
``relaymoe_ring``, ``mcore_alltoall``; ``tokens_per_s`` (median over the steps after 5 warm-up
steps; global tokens per step / step time), ``peak_MiB`` (``max_memory_allocated`` per step on
the reporting rank, the largest after the warm-up), ``steps``, ``losses``, ``wall_s``,
``returncode``, ``max_abs_loss_diff_vs_other`` (ring vs the first alltoall run, the same number
on both rows), ``noise_max_abs_loss_diff`` (alltoall vs alltoall_repeat; the alltoall row also
carries the repeat run as ``repeat_*``), ``parity_ok`` = max_abs_loss_diff_vs_other <=
2 x noise_max_abs_loss_diff + 0.01 (None without ``--noise-run``), and the regime (``regime``,
``lr``, ``min_lr``, ``lr_decay_style``, ``lr_decay_iters``, ``lr_warmup_iters``, ``clip_grad``,
``weight_decay``, ``init_method_std``, ``adam_beta1``, ``adam_beta2``, ``seed``).

A failed run (non-zero exit, timeout, fewer steps than asked, a non-finite loss, or not started
because ``--budget-s`` was spent) is printed with its exit status, command and log tail; its
row says why in ``failure`` and carries no measurement (``tokens_per_s``, ``peak_MiB``,
``final_loss`` are null), and ``parity_ok`` is False on both rows of the shape. The exit status
is 1 when any run failed. ``--dry-run`` prints the planned commands without a GPU.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks.common import ROOT, JsonlWriter
from benchmarks.e2e import (
    REGIMES,
    TE_IMPL,
    RunResult,
    _flag_groups,
    loss_parity,
    merge_flags,
    pretrain_args,
    print_summary,
    run_impl,
    run_pretrain,
    te_version,
)
from relaymoe.options import env_var
from relaymoe.ring.faults import HOST_WAITS

HOST_WAIT_ENV = env_var("host_wait")

PROVIDER = {"ring": "relaymoe_ring", "alltoall": "mcore_alltoall"}
ANCHOR_PROVIDER = "mcore_alltoall_te"  # alltoall with TE and megatron-core's MoE fusions

# megatron-core 0.19.2's MoE path at its best on Hopper with TransformerEngine (issue #31): the
# experts as TEGroupedMLP (grouped GEMM), TE's fused permute/unpermute and fused router top-k,
# and the fused cross-entropy. Every run of a TE shape gets them, the ring's too (the router
# and the loss are the ring's as well; the ring ignores the permute fusion, having no permute).
ANCHOR_FLAGS = (
    "--moe-grouped-gemm",
    "--moe-permute-fusion",
    "--moe-router-fusion",
    "--cross-entropy-loss-fusion",
)
# Further megatron-core options ``--anchor-sweep`` times one at a time on top of ANCHOR_FLAGS:
# name -> (flags of the alltoall runs, flags the ring's runs get when the candidate is kept).
# The ring's share is the part concerning layers both run (attention graphs, the loss): it has
# no use for CUDA graphs of the router and the MoE preprocessing (its token counts are not made
# static) or for TE's activation in TEGroupedMLP. A candidate joins ANCHOR_KEPT only from a
# measured sweep.
_GRAPHS = ("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules")
ANCHOR_CANDIDATES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cuda_graph_moe_router": ((*_GRAPHS, "moe_router", "moe_preprocess"), ()),
    "cuda_graph_attn_moe_router": ((*_GRAPHS, "attn", "moe_router", "moe_preprocess"),
                                   (*_GRAPHS, "attn")),
    "cuda_graph_attn": ((*_GRAPHS, "attn"), (*_GRAPHS, "attn")),
    "cross_entropy_te": (("--cross-entropy-fusion-impl", "te"),
                         ("--cross-entropy-fusion-impl", "te")),
    "te_activation": (("--use-te-activation-func",), ()),
}  # fmt: skip
# Kept from the sweep at 54c58a750d7f on 1x H200 (run 2026-12-02_h200x1_06a6893c75f0, the
# device's git named the session's first commit): base 13,378 and base_repeat 17,228 tokens/s,
# attn + router + preprocess graphs 20,438 (faster than both); router graphs alone 16,692 and
# attention graphs alone 17,760 (not faster than both by more than the bases' drift);
# megatron-core refuses TE's cross-entropy ("disabled due to stability issues") and TE's
# activation with the bias-SwiGLU fusion on.
ANCHOR_KEPT: tuple[str, ...] = ("cuda_graph_attn_moe_router",)
# megatron-core 0.19.2 refuses partial CUDA graphs under full recompute ("full recompute is only
# supported with full iteration CUDA graph"): a shape that recomputes fully runs without them.
_GRAPH_FLAGS = ("--cuda-graph-impl", "--cuda-graph-modules")


def drop_refused_graphs(flags) -> list[str]:
    """``flags`` without the CUDA-graph options when they recompute fully (Megatron's refusal)."""
    groups = _flag_groups(list(flags))
    full = any(g[0] == "--recompute-granularity" and g[1:] == ["full"] for g in groups)
    return [t for g in groups if not (full and g[0] in _GRAPH_FLAGS) for t in g]


def kept_in(flags, dispatcher: str) -> list[str]:
    """The ANCHOR_KEPT candidates whose flags (for ``dispatcher``'s runs) ``flags`` carry."""
    have = {g[0]: g[1:] for g in _flag_groups(list(flags))}
    out = []
    for name in ANCHOR_KEPT:
        want = _flag_groups(list(ANCHOR_CANDIDATES[name][0 if dispatcher == "alltoall" else 1]))
        if all(have.get(g[0]) == g[1:] for g in want):
            out.append(name)
    return out


FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise")  # TE's fp8 recipes on Hopper (mxfp8: sm100)
DEFAULT_CONFIG = "tiny_qwen3"
DEFAULT_STEPS = 200  # the default (tiny) mode
SHAPE_STEPS = 50  # --shapes
MIN_RUN_S = 60  # a run is not started with less of --budget-s left (start-up alone is ~40 s)


@dataclass(frozen=True)
class E2EShape:
    """A config trained at one sequence length and micro-batch (global batch = micro-batch x
    data-parallel size) under one regime."""

    name: str
    config: str
    seq_length: int | None = None  # None: the config's
    micro_batch_size: int | None = None  # None: the config's
    recompute_modules: tuple[str, ...] = ()  # selective recompute of these; () none
    regime: str = "stable"
    fused_loss: bool = False  # the ring run adds --relaymoe-fused-loss (alltoall runs never)
    extra: tuple[str, ...] = ()  # flags of every run of the shape (e.g. pipeline parallelism)
    transformer_impl: str | None = None  # None: TE where it imports (e2e.resolve_impl)
    anchor: bool = False  # TE with ANCHOR_FLAGS (and the kept candidates): mcore_alltoall_te
    fp8: tuple[str, str] | None = None  # (format, recipe) of every run
    row_shape: str | None = None  # the rows' "shape" (default: the name)

    @property
    def shape_label(self) -> str:
        return self.row_shape or self.name

    def run_flags(self, dispatcher: str) -> tuple[str, ...]:
        """Flags of this shape's ``dispatcher`` runs beyond the config's: ``extra``, the anchor's
        options (a kept candidate's alltoall or ring flags) and the fp8 recipe."""
        out = list(self.extra)
        if self.anchor:
            out += ANCHOR_FLAGS
            for name in ANCHOR_KEPT:
                out += ANCHOR_CANDIDATES[name][0 if dispatcher == "alltoall" else 1]
        if self.fp8 is not None:
            fmt, recipe = self.fp8
            out += ["--fp8-format", fmt, "--fp8-recipe", recipe]
        return tuple(out)


_PP2 = ("--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "1")
SHAPES = {
    s.name: s
    for s in (
        E2EShape("qwen3_slice_s4k", "qwen3_slice", seq_length=4096, micro_batch_size=1),
        E2EShape(
            "qwen3_slice_s16k",
            "qwen3_slice",
            seq_length=16384,
            micro_batch_size=1,
            recompute_modules=("core_attn",),
        ),
        # issue #17 item 3: Megatron's 1F1B schedule (and the interleaved one) with the ring, PP=2
        # on 2 GPUs, EP=1 (the ring is a world of one), 2 micro-batches a step
        E2EShape("tiny_qwen3_pp2", "tiny_qwen3", extra=_PP2),
        E2EShape(
            "tiny_qwen3_pp2_vpp2",
            "tiny_qwen3",
            extra=(*_PP2, "--num-layers-per-virtual-pipeline-stage", "1"),
        ),
        # issue #36: expert MLPs other than SwiGLU, ring against alltoall (the tiny model at
        # its own sequence and micro-batch, EP = GPUs)
        E2EShape("tiny_qwen3_gelu", "tiny_qwen3_gelu"),
        E2EShape("tiny_qwen3_squared_relu", "tiny_qwen3_squared_relu"),
        E2EShape(
            "qwen3_slice_v152k_s4k_fused_loss",
            "qwen3_slice_v152k",
            seq_length=4096,
            micro_batch_size=1,
            fused_loss=True,
        ),
        # issue #31: the TE stack, ring against megatron-core at its best (mcore_alltoall_te)
        E2EShape("qwen3_slice_s4k_te", "qwen3_slice", seq_length=4096, micro_batch_size=1,
                 transformer_impl=TE_IMPL, anchor=True),
        E2EShape("qwen3_slice_v152k_s4k_fused_loss_te", "qwen3_slice_v152k", seq_length=4096,
                 micro_batch_size=1, fused_loss=True, transformer_impl=TE_IMPL, anchor=True),
        # the same without the fused loss: tells the loss from the MoE where ring and alltoall
        # train apart on the v152k shape (session 18: final loss 5.3 against 7.7, noise 0.48)
        E2EShape("qwen3_slice_v152k_s4k_te", "qwen3_slice_v152k", seq_length=4096,
                 micro_batch_size=1, transformer_impl=TE_IMPL, anchor=True),
        *(
            E2EShape(f"qwen3_slice_s4k_te_fp8_{fmt}_{recipe}", "qwen3_slice", seq_length=4096,
                     micro_batch_size=1, transformer_impl=TE_IMPL, anchor=True,
                     fp8=(fmt, recipe), row_shape="qwen3_slice_s4k_te_fp8")
            for fmt in FP8_FORMATS
            for recipe in FP8_RECIPES
        ),
    )
}  # fmt: skip


def config_shape(config: str, steps: int, transformer_impl: str | None = None) -> E2EShape:
    """The default mode: a config as it is, under the launcher's regime (the committed rows),
    with ``transformer_impl`` (None: TE where it imports; rows say which ran)."""
    return E2EShape(f"{config}_steps{steps}", config, regime="launcher",
                    transformer_impl=transformer_impl)  # fmt: skip


@dataclass(frozen=True)
class PlannedRun:
    shape: E2EShape
    label: str  # ring | alltoall | alltoall_repeat
    dispatcher: str
    regime: str
    flags: tuple[str, ...]


def plan_runs(
    shape: E2EShape,
    *,
    gpus: int,
    steps: int,
    seed: int,
    noise_run: bool,
    regime: str | None = None,
    check_te: bool = True,
) -> list[PlannedRun]:
    """The runs of one shape in order (ring, alltoall[, alltoall_repeat]) with their flags
    (``check_te=False``: TE shapes planned without TE here, for a dry run)."""
    regime = regime or shape.regime

    def flags(dispatcher: str) -> tuple[str, ...]:
        fused = shape.fused_loss and dispatcher == "ring"
        return tuple(drop_refused_graphs(
            pretrain_args(
                shape.config,
                gpus=gpus,
                steps=steps,
                dispatcher=dispatcher,
                seed=seed,
                extra=[*shape.run_flags(dispatcher), *(["--relaymoe-fused-loss"] if fused else [])],
                seq_length=shape.seq_length,
                micro_batch_size=shape.micro_batch_size,
                recompute_modules=shape.recompute_modules or None,
                regime=regime,
                transformer_impl=shape.transformer_impl,
                check_te=check_te,
            )
        ))  # fmt: skip

    labels = [("ring", "ring"), ("alltoall", "alltoall")]
    if noise_run:
        labels.append(("alltoall_repeat", "alltoall"))
    return [PlannedRun(shape, lab, d, regime, flags(d)) for lab, d in labels]


def _flag(flags, name: str) -> str:
    return flags[list(flags).index(name) + 1]


def shape_rows(
    plans: list[PlannedRun],
    results: dict[str, RunResult],
    *,
    gpus: int,
    steps: int,
    seed: int,
    warm_up_steps: int = 0,
) -> list[dict]:
    """Two rows (ring, alltoall) of one shape from its runs' results (keyed by label)."""
    shape = plans[0].shape
    par = loss_parity(
        results["ring"], results["alltoall"], results.get("alltoall_repeat"), steps=steps
    )
    mbs = int(_flag(plans[0].flags, "--micro-batch-size"))
    flags_of = {p.label: p.flags for p in plans}
    common = {
        "bench": "e2e",
        "shape": shape.shape_label,
        "config": shape.config,
        "ep": int(_flag(plans[0].flags, "--expert-model-parallel-size")),
        "pp": int(_flag(plans[0].flags, "--pipeline-model-parallel-size")),
        "gpus": gpus,
        "seq_length": int(_flag(plans[0].flags, "--seq-length")),
        "micro_batch_size": mbs,
        "global_batch_size": int(_flag(plans[0].flags, "--global-batch-size")),
        "recompute": list(shape.recompute_modules) or None,
        "steps_requested": steps,
        "seed": seed,
        "ring_host_wait": os.environ.get(HOST_WAIT_ENV, HOST_WAITS[0]),  # the ring inherits it
        **REGIMES[plans[0].regime].row_fields(steps),
        "max_abs_loss_diff_vs_other": par["max_abs_loss_diff"],
        "mean_abs_loss_diff_vs_other": par["mean_abs_loss_diff"],
        "noise_max_abs_loss_diff": par["noise_max_abs_loss_diff"],
        "noise_mean_abs_loss_diff": par["noise_mean_abs_loss_diff"],
        "noise_run": "alltoall_repeat" in results,
        "parity_bound": par["parity_bound"],
        "parity_ok": par["parity_ok"],
        "partial_steps": par["partial_steps"],
        "partial_max_abs_loss_diff": par["partial_max_abs_loss_diff"],
        "partial_noise_max_abs_loss_diff": par["partial_noise_max_abs_loss_diff"],
        "te_version": te_version(),
        "fp8_format": shape.fp8[0] if shape.fp8 else None,
        "fp8_recipe": shape.fp8[1] if shape.fp8 else None,
        "anchor_flags": list(ANCHOR_FLAGS) if shape.anchor else None,
        "anchor_kept": kept_in(flags_of["alltoall"], "alltoall") if shape.anchor else None,
        "warm_up_steps": warm_up_steps,
    }
    rows = []
    for label in ("ring", "alltoall"):
        r = results[label]
        row = {
            **common,
            "provider": _provider(r.dispatcher, shape),
            "fused_loss": shape.fused_loss and label == "ring",
            "transformer_impl": run_impl(flags_of[label]),
            "flags": list(flags_of[label]),
            **_run_fields(r, steps),
        }
        if label == "alltoall" and "alltoall_repeat" in results:
            rep = _run_fields(results["alltoall_repeat"], steps)
            row.update({f"repeat_{k}": v for k, v in rep.items() if k != "dispatcher"})
        rows.append(row)
    return rows


def _provider(dispatcher: str, shape: E2EShape) -> str:
    """``mcore_alltoall_te`` for the alltoall runs of an anchor shape, else by dispatcher."""
    if dispatcher == "alltoall" and shape.anchor:
        return ANCHOR_PROVIDER
    return PROVIDER[dispatcher]


def _max_after_warmup(r: RunResult, key: str, warmup: int = 5) -> int | None:
    vals = [s[key] for s in r.steps[warmup:] if key in s]
    return max(vals) if vals else None


def _run_fields(r: RunResult, steps: int) -> dict:
    why = r.failure(steps)
    ok = why is None
    out = {
        "dispatcher": r.dispatcher,
        "steps": len(r.steps),
        "failure": why,
        "tokens_per_s": r.tokens_per_s() if ok else None,
        "peak_MiB": r.peak_mib() if ok else None,
        "warmup_peak_MiB": r.warmup_peak_mib() if ok else None,
        "first_loss": r.losses[0] if ok else None,
        "final_loss": r.losses[-1] if ok else None,
        "losses": r.losses,  # as reported (a failed run's partial curve; no data)
        # expert-weight bytes the ring copied per step after the warm-up (max; 0: views only)
        "ring_weight_copy_bytes_per_step": _max_after_warmup(r, "ring_weight_copy_bytes")
        if ok
        else None,
        "wall_s": r.seconds,
        "returncode": r.returncode,
    }
    if not ok:
        out["log_tail"] = r.log_tail[-1500:]
    return out


def report_failure(r: RunResult, why: str, file=None) -> None:
    """A failed run on stderr: why, exit status, command and log tail (one line if not started)."""
    file = file or sys.stderr
    if r.note:
        print(f"--- run {r.name} {why}", file=file, flush=True)
        return
    print(
        f"--- run {r.name} failed: {why} (rc={r.returncode})\ncommand: {r.command}\n"
        f"log tail:\n{r.log_tail}\n--- end of {r.name}",
        file=file,
        flush=True,
    )


def run_shapes(
    shapes: list[E2EShape],
    *,
    gpus: int,
    steps: int,
    seed: int,
    noise_run: bool,
    writer: JsonlWriter,
    regime: str | None = None,
    budget_s: float | None = None,
    run_timeout_s: float = 600,
    runner=run_pretrain,
    clock=time.monotonic,
    profile_steps: tuple[int, int] | None = None,
    warm_up_steps: int = 0,
) -> tuple[list[dict], bool]:
    """Run every shape's jobs in order, write its rows when its runs are done.

    Returns the rows and whether every run was complete. ``budget_s`` bounds the whole
    invocation: each run's timeout is at most what is left of it, and a run with less than
    ``MIN_RUN_S`` left is not started (reported as failed). ``profile_steps=(start, end)``:
    the ring and alltoall runs (not the noise run, whose tokens/s then stays unprofiled) run
    Megatron's torch profiler over those steps, and a ``bench: e2e_profile`` row per run
    summarises its trace (``trace_summary.py``). ``warm_up_steps``: before a shape's runs, its
    ring and alltoall configurations each train that many steps, unrecorded, so that the
    measured runs find the compile caches (torch.compile's of Megatron's fused functions,
    Triton's, TE's) as a training run finds them after its first minutes: a first run on a
    fresh machine measured 13,378 tokens/s where the same run repeated measured 17,228.
    """
    t0 = clock()
    rows: list[dict] = []
    all_ok = True
    for shape in shapes:
        plans = plan_runs(
            shape, gpus=gpus, steps=steps, seed=seed, noise_run=noise_run, regime=regime
        )
        results: dict[str, RunResult] = {}
        warm = plan_runs(shape, gpus=gpus, steps=warm_up_steps, seed=seed, noise_run=False,
                         regime=regime) if warm_up_steps else []  # fmt: skip
        for p in warm:
            left = None if budget_s is None else budget_s - (clock() - t0)
            if left is not None and left < MIN_RUN_S:
                print(f"[bench_e2e] {shape.name} warm-up {p.label}: not started", flush=True)
                continue
            timeout = run_timeout_s if left is None else min(run_timeout_s, left)
            r = runner(list(p.flags), gpus=gpus, label=f"warm_up_{p.label}", timeout_s=timeout)
            why = r.failure(warm_up_steps)
            print(f"[bench_e2e] {shape.name} warm-up {p.label}: "
                  + ("ok" if why is None else f"FAILED ({why})") + f", {r.seconds:.1f} s",
                  flush=True)  # fmt: skip
        for p in plans:
            left = None if budget_s is None else budget_s - (clock() - t0)
            if left is not None and left < MIN_RUN_S:
                r = RunResult(
                    p.dispatcher,
                    -1,
                    label=p.label,
                    command=" ".join(shlex.quote(f) for f in p.flags),
                    note=f"not started: {max(left, 0):.0f} s of --budget-s {budget_s:.0f} left",
                )
            else:
                timeout = run_timeout_s if left is None else min(run_timeout_s, left)
                print(f"[bench_e2e] {shape.name} {p.label}: starting", flush=True)
                if profile_steps is not None and p.label in PROFILED_LABELS:
                    workdir = tempfile.mkdtemp(prefix=f"relaymoe_e2e_prof_{p.label}_")
                    r = runner([*p.flags, *profile_flags(profile_steps, workdir)], gpus=gpus,
                               label=p.label, timeout_s=timeout, workdir=workdir)  # fmt: skip
                    writer.write(profile_row(shape, p, workdir, profile_steps))
                else:
                    r = runner(list(p.flags), gpus=gpus, label=p.label, timeout_s=timeout)
            why = r.failure(steps)
            tps = r.tokens_per_s() if why is None else None
            print(
                f"[bench_e2e] {shape.name} {p.label}: {'ok' if why is None else 'FAILED'} "
                f"rc={r.returncode} steps={len(r.steps)} wall {r.seconds:.1f} s"
                + (f", {tps:.0f} tokens/s" if tps else "")
                + (f" ({why})" if why else ""),
                flush=True,
            )
            if why is not None:
                all_ok = False
                report_failure(r, why)
            results[p.label] = r
        print(f"== {shape.name}")
        print_summary(list(results.values()), None)
        new = shape_rows(plans, results, gpus=gpus, steps=steps, seed=seed,
                         warm_up_steps=warm_up_steps)  # fmt: skip
        c = new[0]
        print(
            f"max |ring - alltoall| = {_num(c['max_abs_loss_diff_vs_other'])}, "
            f"noise max |alltoall - alltoall| = {_num(c['noise_max_abs_loss_diff'])}, "
            f"bound {_num(c['parity_bound'])} -> parity_ok={c['parity_ok']}",
            flush=True,
        )
        for row in new:
            writer.write(row)
        rows += new
    return rows, all_ok


PROFILED_LABELS = ("ring", "alltoall")


def profile_flags(steps: tuple[int, int], workdir: str) -> list[str]:
    """Megatron's torch-profiler flags over ``steps`` on rank 0; the trace lands in
    ``workdir/torch_profile/rank-0.json.gz`` (Megatron writes it beside ``--tensorboard-dir``)."""
    start, end = steps
    if not 0 < start < end:
        raise ValueError(f"--profile-steps needs 0 < START < END, got {start} {end}")
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(start),
            "--profile-step-end", str(end), "--profile-ranks", "0",
            "--tensorboard-dir", os.path.join(workdir, "tb")]  # fmt: skip


def profile_row(shape: E2EShape, plan, workdir: str, steps: tuple[int, int]) -> dict:
    """``bench: e2e_profile``: the trace of one profiled run summarised, or why there is none."""
    from benchmarks.trace_summary import summarise_file

    trace = os.path.join(workdir, "torch_profile", "rank-0.json.gz")
    row = {"bench": "e2e_profile", "shape": shape.shape_label, "label": plan.label,
           "provider": _provider(plan.dispatcher, shape), "profile_steps": list(steps),
           "flags": list(plan.flags)}  # fmt: skip
    if not os.path.exists(trace):
        return {**row, "failure": f"no trace at {trace}"}
    try:
        return {**row, "failure": None, **summarise_file(trace)}
    except (OSError, ValueError, KeyError) as e:
        return {**row, "failure": f"trace unreadable: {e!r}"}


def sweep_plans(
    shape: E2EShape,
    *,
    gpus: int,
    steps: int,
    seed: int,
    regime: str | None = None,
    check_te: bool = True,
) -> list[tuple[str, tuple[str, ...]]]:
    """The anchor sweep of one anchor shape: ``(label, flags)`` of its alltoall run as it is
    (``base``), then with each of ``ANCHOR_CANDIDATES`` added alone, then ``base`` again (the
    drift of the machine over the sweep)."""
    if not shape.anchor:
        raise ValueError(f"--anchor-sweep needs an anchor shape (with '_te'), got {shape.name!r}")
    base = plan_runs(shape, gpus=gpus, steps=steps, seed=seed, noise_run=False, regime=regime,
                     check_te=check_te)  # fmt: skip
    flags = next(p.flags for p in base if p.label == "alltoall")
    out = [("base", flags)]
    for name, (extra, _ring) in ANCHOR_CANDIDATES.items():
        out.append((name, tuple(merge_flags(list(flags), list(extra)))))
    out.append(("base_repeat", flags))
    return out


def run_anchor_sweep(
    shape: E2EShape,
    *,
    gpus: int,
    steps: int,
    seed: int,
    writer: JsonlWriter,
    regime: str | None = None,
    budget_s: float | None = None,
    run_timeout_s: float = 600,
    runner=run_pretrain,
    clock=time.monotonic,
) -> list[dict]:
    """Time megatron-core's alltoall with each candidate option alone (``sweep_plans``); one row
    ``bench: e2e_anchor_sweep`` per run, with ``speedup_vs_base`` (tokens/s over the first base
    run's). A candidate that fails or is not faster than both base runs is not kept."""
    t0 = clock()
    rows: list[dict] = []
    base_tps = None
    for label, flags in sweep_plans(shape, gpus=gpus, steps=steps, seed=seed, regime=regime):
        left = None if budget_s is None else budget_s - (clock() - t0)
        if left is not None and left < MIN_RUN_S:
            r = RunResult("alltoall", -1, label=label, note=f"not started: {left:.0f} s left")
        else:
            timeout = run_timeout_s if left is None else min(run_timeout_s, left)
            r = runner(list(flags), gpus=gpus, label=label, timeout_s=timeout)
        why = r.failure(steps)
        if why is not None:
            report_failure(r, why)
        fields = _run_fields(r, steps)
        if label == "base":
            base_tps = fields["tokens_per_s"]
        extra, ring_flags = ANCHOR_CANDIDATES.get(label, ((), None))
        tps = fields["tokens_per_s"]
        row = {
            "bench": "e2e_anchor_sweep",
            "shape": shape.shape_label,
            "provider": ANCHOR_PROVIDER,
            "candidate": label,
            "candidate_flags": list(extra),
            "candidate_ring_flags": None if ring_flags is None else list(ring_flags),
            "transformer_impl": run_impl(flags),
            "te_version": te_version(),
            "gpus": gpus,
            "steps_requested": steps,
            "seed": seed,
            "flags": list(flags),
            "speedup_vs_base": tps / base_tps if tps and base_tps else None,
            **fields,
        }
        print(
            f"[anchor sweep] {label}: "
            + (f"{tps:.0f} tokens/s" if tps else f"FAILED ({why})")
            + (f", x{row['speedup_vs_base']:.3f} of base" if row["speedup_vs_base"] else ""),
            flush=True,
        )
        writer.write(row)
        rows.append(row)
    return rows


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None, help=f"default mode's config ({DEFAULT_CONFIG})")
    p.add_argument(
        "--shapes",
        default=None,
        help=f"comma-separated shapes instead of --config: {', '.join(SHAPES)}",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"default {DEFAULT_STEPS}, with --shapes {SHAPE_STEPS}",
    )
    p.add_argument("--quick", action="store_true", help="accepted for the suite; same steps")
    p.add_argument("--noise-run", action="store_true", help="a second alltoall run per shape")
    p.add_argument(
        "--anchor-sweep",
        action="store_true",
        help="with anchor shapes (*_te): time megatron-core's alltoall with each of "
        "ANCHOR_CANDIDATES added alone (rows bench=e2e_anchor_sweep) instead of ring vs alltoall",
    )
    p.add_argument(
        "--regime", default=None, choices=sorted(REGIMES), help="default: the shape's own"
    )
    p.add_argument(
        "--transformer-impl",
        choices=("auto", "transformer_engine", "local"),
        default="auto",
        help="layers of the default mode's runs (auto: Megatron's default, TE, where it imports)",
    )
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--budget-s", type=float, default=None, help="wall-time bound of all runs together"
    )
    p.add_argument("--run-timeout-s", type=float, default=600, help="bound of each run")
    p.add_argument(
        "--warm-up-steps",
        type=int,
        default=0,
        help="before each shape's runs, its ring and alltoall configurations train this many "
        "steps unrecorded (warm compile caches; 0: none)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        nargs=2,
        metavar=("START", "END"),
        default=None,
        help="torch-profile steps [START, END) of the ring and alltoall runs (rows "
        "bench=e2e_profile: GPU time by kernel category, idle fraction)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the planned commands; no GPU")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e.jsonl"))
    a = p.parse_args(argv)
    if a.shapes and a.config:
        p.error("--shapes and --config exclude each other (a shape names its config)")
    if a.shapes:
        names = [s.strip() for s in a.shapes.split(",") if s.strip()]
        unknown = [n for n in names if n not in SHAPES]
        if unknown or not names:
            p.error(f"unknown shape(s) {unknown or names}; known: {', '.join(SHAPES)}")
        steps = a.steps or SHAPE_STEPS
        shapes = [SHAPES[n] for n in names]
    else:
        steps = a.steps or DEFAULT_STEPS
        impl = None if a.transformer_impl == "auto" else a.transformer_impl
        shapes = [config_shape(a.config or DEFAULT_CONFIG, steps, impl)]
    import torch

    if a.gpus:
        gpus = a.gpus
    elif torch.cuda.is_available():
        gpus = min(2, torch.cuda.device_count())
    else:
        gpus = 2  # --dry-run here: the commands of 2 GPUs
    check_te = not a.dry_run
    try:  # bad combinations (e.g. fewer steps than the warm-up) before any GPU time is spent
        planned = [
            plan_runs(s, gpus=gpus, steps=steps, seed=a.seed, noise_run=a.noise_run,
                      regime=a.regime, check_te=check_te)
            for s in shapes
        ]  # fmt: skip
        sweeps = [
            sweep_plans(s, gpus=gpus, steps=steps, seed=a.seed, regime=a.regime,
                        check_te=check_te)
            for s in shapes
        ] if a.anchor_sweep else []  # fmt: skip
        if a.warm_up_steps:
            for s in shapes:
                plan_runs(s, gpus=gpus, steps=a.warm_up_steps, seed=a.seed, noise_run=False,
                          regime=a.regime, check_te=check_te)  # fmt: skip
        if a.profile_steps:
            profile_flags(tuple(a.profile_steps), "-")
            if a.profile_steps[1] > steps:
                raise ValueError(
                    f"--profile-steps end {a.profile_steps[1]} is past --steps {steps}"
                )
    except ValueError as e:
        p.error(str(e))
    if a.dry_run and a.anchor_sweep:
        for shape, sweep in zip(shapes, sweeps, strict=True):
            for label, flags in sweep:
                print(f"# {shape.name} anchor sweep: {label}")
                print(" ".join(shlex.quote(f) for f in flags))
        return 0
    if a.dry_run:
        for runs in planned:
            for r in runs:
                ep = _flag(r.flags, "--expert-model-parallel-size")
                print(f"# {r.shape.name} {r.label} (regime {r.regime}, EP={ep})")
                print(" ".join(shlex.quote(f) for f in r.flags))
        return 0
    if not torch.cuda.is_available():
        print("bench_e2e: needs CUDA GPUs (1 or 2); nothing measured")
        return 3
    t0 = time.perf_counter()
    if a.anchor_sweep:
        writer, ok = JsonlWriter(a.out), True
        for shape in shapes:
            rows = run_anchor_sweep(shape, gpus=gpus, steps=steps, seed=a.seed, writer=writer,
                                    regime=a.regime, budget_s=a.budget_s,
                                    run_timeout_s=a.run_timeout_s)  # fmt: skip
            ok = ok and all(r["failure"] is None for r in rows if r["candidate"] == "base")
        print(f"rows appended to {a.out}; {time.perf_counter() - t0:.0f} s in all")
        return 0 if ok else 1
    _, all_ok = run_shapes(
        shapes,
        gpus=gpus,
        steps=steps,
        seed=a.seed,
        noise_run=a.noise_run,
        writer=JsonlWriter(a.out),
        regime=a.regime,
        budget_s=a.budget_s,
        run_timeout_s=a.run_timeout_s,
        profile_steps=tuple(a.profile_steps) if a.profile_steps else None,
        warm_up_steps=a.warm_up_steps,
    )
    print(f"rows appended to {a.out}; {time.perf_counter() - t0:.0f} s in all")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
