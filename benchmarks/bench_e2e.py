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

Gradient accumulation (issue #49; TE, the anchor's flags, global batch fixed whatever the GPUs,
so ``micro_batches`` = global / (micro-batch x DP) a rank a step):

    qwen3_slice_s4k_gbs16_te, qwen3_slice_s4k_gbs64_te
                       sequence 4096, micro-batch 1, global batch 16 / 64
    qwen3_slice_s16k_gbs8_te
                       sequence 16384, global batch 8, selective recompute of core_attn
    qwen3_slice_v152k_s4k_gbs16_fused_loss_te, qwen3_slice_v152k_s4k_gbs64_fused_loss_te
                       the v152k slice (full recompute), the ring runs with the fused loss

These run by provider (``PROVIDERS``; ``--providers`` picks them for any shape, ``--repeats N``
runs the list N times in order, interleaving the providers over the machine's drift):

    relaymoe_ring           the ring, eager, with the ring's share of the kept anchor graphs
    relaymoe_ring_graphed   the ring under megatron-core's whole-iteration CUDA graph
                            (--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad
                            --cuda-graph-warmup-steps 2; no per-layer graph modules), dropless
    relaymoe_ring_fp8_experts
                            the fp8 shapes' ring with its experts in fp8 too
                            (--relaymoe-fp8-experts on; the default auto keeps them in bf16
                            until they are measured faster): rows with fp8_experts true
    mcore_alltoall_te       the anchor: megatron-core's alltoall at its best, its kept graphs
    mcore_alltoall_te_drop  alltoall dropping tokens at capacity factor 1.0, padded to capacity,
                            with megatron-core's attention and MoE graphs (--cuda-graph-impl
                            transformer_engine --cuda-graph-modules attn moe, which 0.19 accepts
                            only with drop-and-pad): token-dropping, another model
    mcore_alltoall          megatron-core's alltoall on the shapes without TE

Under full recompute (the v152k shapes) megatron-core refuses per-layer graphs: those providers
run without them (``cuda_graph_impl`` "none" in their rows), the whole-iteration graph stays.

Global batch of the other shapes = micro-batch x data-parallel size (= GPUs; no gradient
accumulation), 50 steps, seed 1234. s16k recomputes the attention core: without
TransformerEngine megatron-core's local attention materialises a layer's 32 x 16k x 16k bf16
scores (16 GiB) and keeps its softmax for the backward; by estimate ~145 GiB a rank without the
recompute (4 x 16 kept, a 16 GiB score buffer, 2 x 16 in the backward, ~23 GiB of weights and
optimizer state), ~110 GiB with it.

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

Every ``e2e`` row also carries ``gbs`` and ``micro_batches``, ``cuda_graph_impl`` (from the
flags, "none" without) and ``cuda_graph_modules``, ``tokens_dropped`` (True for a run with an
expert capacity factor: megatron-core logs no count; 0 for dropless runs), ``flops_per_token``
and ``model_tflops_per_gpu`` (tokens/s x ``benchmarks.flops.flops_per_token`` / GPUs: Megatron's
model FLOPs, top-k experts only, recompute not counted), and ``gpu_busy_frac`` (None unless
profiled). Rows of provider runs: one per run, with ``provider``, ``label``, ``repeat``,
``noise``, ``speedup_vs_anchor`` (over the anchor's run of the same pass),
``max_abs_loss_diff_vs_anchor`` (against the anchor's first run), and with ``--noise-run`` (the
anchor once more, last) ``noise_max_abs_loss_diff``, ``parity_bound`` and ``parity_ok`` (None
for a token-dropping run).

``--profile-busy``: every run torch-profiles one step after its warm-up (the second-last of
``--steps``); its row's ``gpu_busy_frac`` is the union of the GPU's kernel and copy intervals
over that step's wall time (``trace_summary.py``), and tokens/s leaves that step and the
profiler's warm-up step before it out (``tokens_per_s_excluded_steps``). A ``bench:
e2e_profile`` row per run holds the split by kernel category. Kernels replayed from a CUDA graph
are in the trace where CUPTI records graph nodes; ``cuda_graph_launches`` tells a graphed step.

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
    flag_value,
    loss_parity,
    merge_flags,
    pretrain_args,
    print_summary,
    run_impl,
    run_pretrain,
    te_version,
)
from benchmarks.flops import model_tflops_per_gpu, shape_flops_per_token
from relaymoe.config import flag_groups
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
    # Megatron's default fuses each weight gradient into main_grad inside the GEMM; TE's
    # GroupedLinear then runs one accumulating GEMM per expert, where without the fusion it runs
    # grouped GEMMs and DDP adds (1x H100, global batch 16: 23,293 tokens/s with the fusion at
    # ea4fbac, 31,933 without at 58d1370, two machine starts). The ring keeps the fusion (its
    # weight-gradient kernel adds into main_grad).
    "no_wgrad_fusion": (("--no-gradient-accumulation-fusion",), ()),
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
    """``flags`` without the per-layer CUDA-graph options when they recompute fully (Megatron's
    refusal); the whole-iteration graph (``--cuda-graph-impl full_iteration``) stays, being what
    megatron-core allows with full recompute."""
    groups = flag_groups(list(flags))
    full = any(g[0] == "--recompute-granularity" and g[1:] == ["full"] for g in groups)
    whole = any(g == ["--cuda-graph-impl", FULL_ITERATION] for g in groups)
    return [t for g in groups if not (full and not whole and g[0] in _GRAPH_FLAGS) for t in g]


def without_graphs(flags) -> list[str]:
    """``flags`` without any CUDA-graph option (impl, modules, warm-up steps)."""
    drop = (*_GRAPH_FLAGS, "--cuda-graph-warmup-steps")
    return [t for g in flag_groups(list(flags)) if g[0] not in drop for t in g]


def cuda_graph_impl(flags) -> str:
    """The ``--cuda-graph-impl`` a flag list runs ("none", Megatron's default, when absent)."""
    groups = {g[0]: g[1:] for g in flag_groups(list(flags))}
    return (groups.get("--cuda-graph-impl") or ["none"])[0]


def kept_in(flags, dispatcher: str) -> list[str]:
    """The ANCHOR_KEPT candidates whose flags (for ``dispatcher``'s runs) ``flags`` carry."""
    have = {g[0]: g[1:] for g in flag_groups(list(flags))}
    out = []
    for name in ANCHOR_KEPT:
        want = flag_groups(list(ANCHOR_CANDIDATES[name][0 if dispatcher == "alltoall" else 1]))
        if all(have.get(g[0]) == g[1:] for g in want):
            out.append(name)
    return out


# -- providers (issue #49): what one run of a shape is, beyond the shape's own flags ---------------
FULL_ITERATION = "full_iteration"
# megatron-core 0.19.2's whole-iteration graph (FullCudaGraphWrapper): forward and backward of
# every micro-batch of a step captured as one graph after this many eager iterations. Megatron
# refuses it with the NaN check on (that check syncs with the host) and with per-layer graph
# modules (cuda_graph_modules must be empty), so the ring's kept attention graphs are dropped.
GRAPH_WARMUP_STEPS = 2
RING_GRAPHED_FLAGS = ("--cuda-graph-impl", FULL_ITERATION, "--no-check-for-nan-in-loss-and-grad",
                      "--cuda-graph-warmup-steps", str(GRAPH_WARMUP_STEPS))  # fmt: skip
# Token dropping at capacity 1.0, each expert's input padded to its capacity: megatron-core's
# alltoall then has static shapes and no device-to-host copy, which is what its MoE CUDA graphs
# need (transformer_config.py asserts "moe cuda graph is only supported with drop-padding MoE").
# Tokens over an expert's capacity are dropped: not the same model as the dropless runs.
# The ring with megatron-core's per-layer graphs over attention and the whole MoE layer (TE's
# make_graphed_callables), dropless: megatron-core's drop-and-pad assertion is lifted for the
# ring only (relaymoe/megatron/patches.py)
RING_LAYER_GRAPH_FLAGS = (
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-modules",
    "attn",
    "moe",
    "--cuda-graph-warmup-steps",
    str(GRAPH_WARMUP_STEPS),
)
DROP_FLAGS = ("--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity")
DROP_GRAPH_FLAGS = ("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn",
                    "moe")  # fmt: skip


@dataclass(frozen=True)
class Provider:
    """One kind of run of a shape: its dispatcher, its flags on top of the shape's
    (``Provider.flags``), and the shapes it applies to (``te``: True for the anchor (TE) shapes
    only, False for the others only, None for both; ``fp8_experts``: the fp8 shapes only)."""

    name: str
    dispatcher: str
    te: bool | None = None
    graph_flags: tuple[str, ...] | None = None  # replace the shape's CUDA-graph flags; None: keep
    extra: tuple[str, ...] = ()
    about: str = ""
    fp8_experts: bool = False  # the ring's experts in fp8 (--relaymoe-fp8-experts on)

    def flags(self, shape: E2EShape) -> tuple[str, ...]:
        """The run's flags beyond the config's: the shape's for this dispatcher
        (``E2EShape.run_flags``), its CUDA-graph flags replaced by ``graph_flags`` where given,
        then ``extra``, and the fused loss on the ring's runs of a fused-loss shape."""
        if self.te is not None and self.te != shape.anchor:
            need = "an anchor (TE, '_te') shape" if self.te else "a shape without '_te'"
            raise ValueError(f"provider {self.name!r} runs on {need}, not {shape.name!r}")
        if self.fp8_experts and shape.fp8 is None:
            raise ValueError(f"provider {self.name!r} runs on an fp8 shape ('_fp8_'), not "
                             f"{shape.name!r}")  # fmt: skip
        out = list(shape.run_flags(self.dispatcher))
        if self.graph_flags is not None:
            out = [*without_graphs(out), *self.graph_flags]
        out += self.extra
        if shape.fused_loss and self.dispatcher == "ring":
            out.append("--relaymoe-fused-loss")
        if self.fp8_experts:
            out += ["--relaymoe-fp8-experts", "on"]
        return tuple(out)


PROVIDERS = {
    p.name: p
    for p in (
        Provider("relaymoe_ring", "ring",
                 about="the ring, eager (with the kept attention graphs on anchor shapes)"),
        Provider("relaymoe_ring_graphed", "ring", graph_flags=RING_GRAPHED_FLAGS,
                 about="the ring under megatron-core's whole-iteration CUDA graph, dropless"),
        Provider("relaymoe_ring_fp8_experts", "ring", fp8_experts=True,
                 about="the ring with its experts' GEMMs in fp8 too (--relaymoe-fp8-experts "
                       "on; the fp8 shapes: the default auto keeps them in bf16)"),
        Provider("relaymoe_ring_layer_graphs", "ring", te=True,
                 graph_flags=RING_LAYER_GRAPH_FLAGS,
                 about="the ring under megatron-core's per-layer graphs over attention and the "
                       "whole MoE layer (TE), dropless"),
        Provider("mcore_alltoall", "alltoall", te=False,
                 about="megatron-core's alltoall (shapes without TE)"),
        Provider("mcore_alltoall_te", "alltoall", te=True,
                 about="megatron-core's alltoall at its best with TE: the anchor, kept graphs"),
        Provider("mcore_alltoall_te_drop", "alltoall", te=True, graph_flags=DROP_GRAPH_FLAGS,
                 extra=DROP_FLAGS,
                 about="megatron-core's alltoall dropping tokens at capacity 1.0, padded, with "
                       "its attention and MoE CUDA graphs (token-dropping: another model)"),
    )
}  # fmt: skip
GBS_PROVIDERS = ("relaymoe_ring", "relaymoe_ring_graphed", "mcore_alltoall_te",
                 "mcore_alltoall_te_drop", "relaymoe_ring_layer_graphs")  # fmt: skip
# no local per-layer graphs: relaymoe refuses them for the ring (relaymoe.megatron.validate)
LOCAL_GBS_PROVIDERS = ("relaymoe_ring", "relaymoe_ring_graphed", "mcore_alltoall")


def anchor_provider(shape: E2EShape) -> str:
    """The provider the others of a shape are compared with: megatron-core's dropless alltoall."""
    return ANCHOR_PROVIDER if shape.anchor else PROVIDER["alltoall"]


def tokens_dropped(flags) -> bool | int:
    """True for a run that may drop tokens (an expert capacity factor), else 0 (dropless).
    megatron-core logs no count of the tokens it drops."""
    return True if flag_value(list(flags), "--moe-expert-capacity-factor") is not None else 0


FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise")  # TE's fp8 recipes on Hopper (mxfp8: sm100)
DEFAULT_CONFIG = "tiny_qwen3"
DEFAULT_STEPS = 200  # the default (tiny) mode
SHAPE_STEPS = 50  # --shapes
MIN_RUN_S = 60  # a run is not started with less of --budget-s left (start-up alone is ~40 s)


@dataclass(frozen=True)
class E2EShape:
    """A config trained at one sequence length, micro-batch and global batch (None: micro-batch x
    data-parallel size, one micro-batch a step; else gradients accumulated over global /
    (micro-batch x DP) micro-batches) under one regime. ``providers``: the shape's runs by
    provider (``PROVIDERS``, in order); None: the ring, alltoall[, alltoall_repeat] runs."""

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
    global_batch_size: int | None = None  # None: micro-batch x data-parallel size
    providers: tuple[str, ...] | None = None  # None: ring, alltoall[, alltoall_repeat]

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
        # issue #49: gradient accumulation as users train (global batch 16 = 16 micro-batches at
        # 1 GPU), each run by the eager ring, the ring under the whole-iteration graph, the anchor
        # and the token-dropping graphed anchor
        *(
            E2EShape(f"qwen3_slice_s4k_gbs{gbs}_te", "qwen3_slice", seq_length=4096,
                     micro_batch_size=1, global_batch_size=gbs, transformer_impl=TE_IMPL,
                     anchor=True, providers=GBS_PROVIDERS)
            for gbs in (16, 64)
        ),
        # the same comparison where TE is absent: megatron-core's local layers, its alltoall
        # as it runs there (no TE fusions or graphs to keep)
        E2EShape("qwen3_slice_s4k_gbs16", "qwen3_slice", seq_length=4096, micro_batch_size=1,
                 global_batch_size=16, transformer_impl="local", providers=LOCAL_GBS_PROVIDERS),
        E2EShape("qwen3_slice_s16k_gbs8_te", "qwen3_slice", seq_length=16384, micro_batch_size=1,
                 global_batch_size=8, recompute_modules=("core_attn",), transformer_impl=TE_IMPL,
                 anchor=True, providers=GBS_PROVIDERS),
        *(
            E2EShape(f"qwen3_slice_v152k_s4k_gbs{gbs}_fused_loss_te", "qwen3_slice_v152k",
                     seq_length=4096, micro_batch_size=1, global_batch_size=gbs, fused_loss=True,
                     transformer_impl=TE_IMPL, anchor=True, providers=GBS_PROVIDERS)
            for gbs in (16, 64)
        ),
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
    label: str  # ring | alltoall | alltoall_repeat; with providers the provider[_rN | _noise]
    dispatcher: str
    regime: str
    flags: tuple[str, ...]
    provider: str = ""  # PROVIDERS key
    repeat: int = 0  # which pass over the provider list (--repeats)
    noise: bool = False  # the anchor run again with its first run's flags (--noise-run)


def provider_run_flags(
    shape: E2EShape,
    provider: str,
    *,
    gpus: int,
    steps: int,
    seed: int,
    regime: str,
    check_te: bool = True,
) -> tuple[str, ...]:
    """Every flag of ``provider``'s run of ``shape`` (``pretrain_args`` with the provider's
    ``Provider.flags``; per-layer graphs left out under full recompute)."""
    p = PROVIDERS[provider]
    return tuple(drop_refused_graphs(
        pretrain_args(
            shape.config,
            gpus=gpus,
            steps=steps,
            dispatcher=p.dispatcher,
            seed=seed,
            extra=list(p.flags(shape)),
            seq_length=shape.seq_length,
            micro_batch_size=shape.micro_batch_size,
            recompute_modules=shape.recompute_modules or None,
            regime=regime,
            transformer_impl=shape.transformer_impl,
            check_te=check_te,
            global_batch_size=shape.global_batch_size,
        )
    ))  # fmt: skip


def shape_providers(shape: E2EShape, providers=None) -> tuple[str, ...] | None:
    """The providers a shape runs (``providers`` given, else the shape's own), checked against
    ``PROVIDERS`` and the shape; None: the ring/alltoall runs of the shapes before providers."""
    chosen = tuple(providers) if providers else shape.providers
    if chosen is None:
        return None
    unknown = [p for p in chosen if p not in PROVIDERS]
    if unknown or not chosen:
        raise ValueError(f"unknown provider(s) {unknown or chosen}; known: {', '.join(PROVIDERS)}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"a provider named twice in {list(chosen)}: use --repeats")
    for p in chosen:
        PROVIDERS[p].flags(shape)  # raises for a provider that does not apply to the shape
    return chosen


def plan_runs(
    shape: E2EShape,
    *,
    gpus: int,
    steps: int,
    seed: int,
    noise_run: bool,
    regime: str | None = None,
    check_te: bool = True,
    providers=None,
    repeats: int = 1,
) -> list[PlannedRun]:
    """The runs of one shape in order with their flags (``check_te=False``: TE shapes planned
    without TE here, for a dry run).

    Without providers (``providers`` None and none in the shape): ring, alltoall[,
    alltoall_repeat]. With providers: the provider list ``repeats`` times in order (labels: the
    provider, then ``<provider>_r<N>`` for pass N > 0), so that the providers' runs interleave
    over the machine's drift; ``noise_run`` adds the anchor once more at the end (label
    ``<anchor>_noise``) with its first run's exact flags."""
    regime = regime or shape.regime
    chosen = shape_providers(shape, providers)
    if chosen is None:
        if repeats != 1:
            raise ValueError(f"--repeats needs providers (--providers); {shape.name!r} has none")
        labels = [("ring", "ring"), ("alltoall", "alltoall")]
        if noise_run:
            labels.append(("alltoall_repeat", "alltoall"))
        return [
            PlannedRun(shape, lab, d, regime, provider_run_flags(
                shape, _provider(d, shape), gpus=gpus, steps=steps, seed=seed, regime=regime,
                check_te=check_te), provider=_provider(d, shape))
            for lab, d in labels
        ]  # fmt: skip
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    flags = {
        p: provider_run_flags(shape, p, gpus=gpus, steps=steps, seed=seed, regime=regime,
                              check_te=check_te)
        for p in chosen
    }  # fmt: skip
    out = [
        PlannedRun(shape, p if rep == 0 else f"{p}_r{rep}", PROVIDERS[p].dispatcher, regime,
                   flags[p], provider=p, repeat=rep)
        for rep in range(repeats)
        for p in chosen
    ]  # fmt: skip
    if noise_run:
        anchor = anchor_provider(shape)
        if anchor not in chosen:
            raise ValueError(f"--noise-run repeats the anchor {anchor!r}: add it to the providers")
        out.append(PlannedRun(shape, f"{anchor}_noise", "alltoall", regime, flags[anchor],
                              provider=anchor, noise=True))  # fmt: skip
    return out


def _flag(flags, name: str) -> str:
    return flags[list(flags).index(name) + 1]


def batch_fields(flags, gpus: int) -> dict:
    """``gbs`` and ``micro_batches`` (gbs / (micro-batch x data-parallel size), the micro-batches
    each rank accumulates a step) of a flag list on ``gpus`` GPUs."""
    groups = {g[0]: g[1:] for g in flag_groups(list(flags))}

    def size(name: str) -> int:
        return int((groups.get(name) or ["1"])[0])

    model_parallel = (size("--tensor-model-parallel-size") * size("--pipeline-model-parallel-size")
                      * size("--context-parallel-size"))  # fmt: skip
    dp = gpus // model_parallel
    gbs, mbs = size("--global-batch-size"), size("--micro-batch-size")
    return {"gbs": gbs, "micro_batches": gbs // (mbs * dp)}


def shape_flops(shape: E2EShape, flags) -> float:
    """Model FLOPs of a token of ``shape`` (``benchmarks.flops``) at its runs' sequence and TP."""
    return shape_flops_per_token(shape.config, int(_flag(flags, "--seq-length")),
                                 tp=int(_flag(flags, "--tensor-model-parallel-size")))  # fmt: skip


def _run_extras(flags, fields: dict, *, gpus: int, fpt: float, profile: dict | None) -> dict:
    """Fields of a run's row read from its flags, its tokens/s and its profiled step."""
    groups = {g[0]: g[1:] for g in flag_groups(list(flags))}
    busy = profile.get("gpu_busy_frac") if profile and profile.get("failure") is None else None
    return {
        "cuda_graph_impl": cuda_graph_impl(flags),
        "cuda_graph_modules": groups.get("--cuda-graph-modules"),
        "tokens_dropped": tokens_dropped(flags),
        "model_tflops_per_gpu": model_tflops_per_gpu(fields["tokens_per_s"], fpt, gpus),
        "gpu_busy_frac": busy,
        "profile_steps": profile["profile_steps"] if profile else None,
    }


def _shape_fields(plans: list[PlannedRun], *, gpus: int, steps: int, seed: int, fpt: float) -> dict:
    """The fields that name a shape's runs (parallelism, batch, model flops, seed, regime): the
    same in ``shape_rows`` and ``provider_rows``, read from the shape's first plan, whose sizes
    every run of the shape shares."""
    shape, flags = plans[0].shape, plans[0].flags
    return {
        "bench": "e2e",
        "shape": shape.shape_label,
        "config": shape.config,
        "ep": int(_flag(flags, "--expert-model-parallel-size")),
        "pp": int(_flag(flags, "--pipeline-model-parallel-size")),
        "gpus": gpus,
        "seq_length": int(_flag(flags, "--seq-length")),
        "micro_batch_size": int(_flag(flags, "--micro-batch-size")),
        "global_batch_size": int(_flag(flags, "--global-batch-size")),
        **batch_fields(flags, gpus),
        "flops_per_token": fpt,
        "recompute": list(shape.recompute_modules) or None,
        "steps_requested": steps,
        "seed": seed,
        "ring_host_wait": os.environ.get(HOST_WAIT_ENV, HOST_WAITS[0]),  # the ring inherits it
        **REGIMES[plans[0].regime].row_fields(steps),
    }


def _stack_fields(shape: E2EShape, warm_up_steps: int) -> dict:
    """The software stack and precision of a shape's runs (TE version, fp8, anchor flags) and
    their warm-up: the same in ``shape_rows`` and ``provider_rows``."""
    return {
        "te_version": te_version(),
        "fp8_format": shape.fp8[0] if shape.fp8 else None,
        "fp8_recipe": shape.fp8[1] if shape.fp8 else None,
        "anchor_flags": list(ANCHOR_FLAGS) if shape.anchor else None,
        "warm_up_steps": warm_up_steps,
    }


def shape_rows(
    plans: list[PlannedRun],
    results: dict[str, RunResult],
    *,
    gpus: int,
    steps: int,
    seed: int,
    warm_up_steps: int = 0,
    profiles: dict[str, dict] | None = None,
) -> list[dict]:
    """Two rows (ring, alltoall) of one shape from its runs' results (keyed by label);
    ``profiles``: the ``e2e_profile`` rows of the profiled runs, by label."""
    shape = plans[0].shape
    profiles = profiles or {}
    par = loss_parity(
        results["ring"], results["alltoall"], results.get("alltoall_repeat"), steps=steps
    )
    flags_of = {p.label: p.flags for p in plans}
    fpt = shape_flops(shape, plans[0].flags)
    exclude = _profiled_steps(profiles)
    common = {
        **_shape_fields(plans, gpus=gpus, steps=steps, seed=seed, fpt=fpt),
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
        **_stack_fields(shape, warm_up_steps),
        "anchor_kept": kept_in(flags_of["alltoall"], "alltoall") if shape.anchor else None,
    }
    rows = []
    for label in ("ring", "alltoall"):
        r = results[label]
        fields = _run_fields(r, steps, exclude.get(label, ()))
        row = {
            **common,
            "provider": _provider(r.dispatcher, shape),
            "fused_loss": shape.fused_loss and label == "ring",
            "transformer_impl": run_impl(flags_of[label]),
            "flags": list(flags_of[label]),
            **fields,
            **_run_extras(flags_of[label], fields, gpus=gpus, fpt=fpt,
                          profile=profiles.get(label)),
        }  # fmt: skip
        if label == "alltoall" and "alltoall_repeat" in results:
            rep = _run_fields(results["alltoall_repeat"], steps, exclude.get("alltoall_repeat", ()))
            row.update({f"repeat_{k}": v for k, v in rep.items() if k != "dispatcher"})
        rows.append(row)
    return rows


def provider_rows(
    plans: list[PlannedRun],
    results: dict[str, RunResult],
    *,
    gpus: int,
    steps: int,
    seed: int,
    warm_up_steps: int = 0,
    profiles: dict[str, dict] | None = None,
) -> list[dict]:
    """One row per run of a shape planned with providers, in run order.

    Against the anchor's first run (``anchor_provider``; the anchor's own first row has none):
    ``max_abs_loss_diff_vs_anchor`` / ``mean_...`` over the steps, and ``speedup_vs_anchor``
    (tokens/s over the anchor run of the same pass, so that interleaved passes compare runs
    made close in time). With ``--noise-run``: ``noise_max_abs_loss_diff`` (the anchor against
    its noise run), ``parity_bound`` and ``parity_ok`` (``loss_parity``; None for a run that
    drops tokens, which trains another model). ``profiles``: ``e2e_profile`` rows by label."""
    shape = plans[0].shape
    profiles = profiles or {}
    exclude = _profiled_steps(profiles)
    anchor = anchor_provider(shape)
    first = {}  # provider -> its first run's label
    for p in plans:
        first.setdefault(p.provider, p.label)
    anchor0 = results.get(first.get(anchor, ""))
    noise = next((results[p.label] for p in plans if p.noise), None)
    anchor_tps = {p.repeat: _run_fields(results[p.label], steps, exclude.get(p.label, ()))
                  for p in plans if p.provider == anchor and not p.noise}  # fmt: skip
    fpt = shape_flops(shape, plans[0].flags)
    noise_par = (loss_parity(anchor0, anchor0, noise, steps=steps)
                 if anchor0 is not None and noise is not None else {})  # fmt: skip
    common = {
        **_shape_fields(plans, gpus=gpus, steps=steps, seed=seed, fpt=fpt),
        "providers": list(dict.fromkeys(p.provider for p in plans)),
        "repeats": 1 + max(p.repeat for p in plans),
        "anchor_provider": anchor,
        "noise_run": noise is not None,
        "noise_max_abs_loss_diff": noise_par.get("noise_max_abs_loss_diff"),
        "noise_mean_abs_loss_diff": noise_par.get("noise_mean_abs_loss_diff"),
        **_stack_fields(shape, warm_up_steps),
    }
    rows = []
    for p in plans:
        r = results[p.label]
        fields = _run_fields(r, steps, exclude.get(p.label, ()))
        extras = _run_extras(p.flags, fields, gpus=gpus, fpt=fpt, profile=profiles.get(p.label))
        is_anchor0 = p.label == first.get(anchor)
        par = (loss_parity(r, anchor0, noise, steps=steps)
               if anchor0 is not None and not is_anchor0 else {})  # fmt: skip
        ref = anchor_tps.get(p.repeat) or anchor_tps.get(0)
        tps, ref_tps = fields["tokens_per_s"], ref["tokens_per_s"] if ref else None
        dropping = bool(extras["tokens_dropped"])
        rows.append({
            **common,
            "provider": p.provider,
            "label": p.label,
            "repeat": p.repeat,
            "noise": p.noise,
            "fused_loss": "--relaymoe-fused-loss" in p.flags,
            "transformer_impl": run_impl(p.flags),
            "anchor_kept": kept_in(p.flags, p.dispatcher) if shape.anchor else None,
            "flags": list(p.flags),
            **fields,
            **extras,
            "speedup_vs_anchor": tps / ref_tps if tps and ref_tps else None,
            "max_abs_loss_diff_vs_anchor": par.get("max_abs_loss_diff"),
            "mean_abs_loss_diff_vs_anchor": par.get("mean_abs_loss_diff"),
            "parity_bound": par.get("parity_bound"),
            "parity_ok": None if dropping or is_anchor0 else par.get("parity_ok"),
        })  # fmt: skip
    return rows


def _provider(dispatcher: str, shape: E2EShape) -> str:
    """``mcore_alltoall_te`` for the alltoall runs of an anchor shape, else by dispatcher."""
    if dispatcher == "alltoall" and shape.anchor:
        return ANCHOR_PROVIDER
    return PROVIDER[dispatcher]


def _max_after_warmup(r: RunResult, key: str, warmup: int = 5) -> int | None:
    vals = [s[key] for s in r.steps[warmup:] if key in s]
    return max(vals) if vals else None


def _run_fields(r: RunResult, steps: int, exclude=()) -> dict:
    """A run's measurements (none for a failed run); ``exclude``: 1-based steps left out of
    tokens/s (a profiled step and the profiler's warm-up step before it)."""
    why = r.failure(steps)
    ok = why is None
    out = {
        "dispatcher": r.dispatcher,
        "steps": len(r.steps),
        "failure": why,
        "tokens_per_s": r.tokens_per_s(exclude=exclude) if ok else None,
        "tokens_per_s_excluded_steps": sorted(exclude),
        "peak_MiB": r.peak_mib() if ok else None,
        "warmup_peak_MiB": r.warmup_peak_mib() if ok else None,
        "first_loss": r.losses[0] if ok else None,
        "final_loss": r.losses[-1] if ok else None,
        "losses": r.losses,  # as reported (a failed run's partial curve; no data)
        # expert-weight bytes the ring copied per step after the warm-up (max; 0: views only)
        "ring_weight_copy_bytes_per_step": _max_after_warmup(r, "ring_weight_copy_bytes")
        if ok
        else None,
        # expert-weight bytes the reporting rank sent its EP peers per step after the warm-up
        # (max; 0 at EP 1): the fp8 experts' copies and scales, or the bf16 weights
        "ring_weight_bytes_sent_per_step": _max_after_warmup(r, "ring_weight_bytes_sent")
        if ok
        else None,
        # the ring's experts computed in fp8 (the step report's fp8_experts)
        "fp8_experts": any(s.get("fp8_experts") for s in r.steps) if ok else None,
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


class _Budget:
    """What is left of ``--budget-s`` (None: unbounded) for the next run, on ``clock`` from the
    start of the invocation, and the timeout that run gets (at most what is left)."""

    def __init__(self, budget_s: float | None, run_timeout_s: float, clock):
        self.budget_s, self.run_timeout_s, self.clock = budget_s, run_timeout_s, clock
        self.t0 = clock()

    def next_run(self) -> tuple[float | None, float | None]:
        """``(left, timeout)``: the seconds left (None: no budget) and the next run's timeout,
        None when fewer than ``MIN_RUN_S`` are left (the run is not started)."""
        left = None if self.budget_s is None else self.budget_s - (self.clock() - self.t0)
        if left is not None and left < MIN_RUN_S:
            return left, None
        return left, self.run_timeout_s if left is None else min(self.run_timeout_s, left)


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
    providers=None,
    repeats: int = 1,
    profile_busy: bool = False,
) -> tuple[list[dict], bool]:
    """Run every shape's jobs in order, write its rows when its runs are done.

    Returns the rows and whether every run was complete. ``budget_s`` bounds the whole
    invocation: each run's timeout is at most what is left of it, and a run with less than
    ``MIN_RUN_S`` left is not started (reported as failed). ``profile_steps=(start, end)``:
    the ring and alltoall runs (not the noise run, whose tokens/s then stays unprofiled) run
    Megatron's torch profiler over those steps, and a ``bench: e2e_profile`` row per run
    summarises its trace (``trace_summary.py``). ``profile_busy``: every run profiles one step,
    ``profile_busy_steps(steps)``, the same way; its row carries the step's ``gpu_busy_frac``.
    The steps the profiler slows (``profiler_slowed_steps``) are left out of tokens/s.
    ``warm_up_steps``: before a shape's runs, its configurations (ring and alltoall, or each
    provider) each train that many steps, unrecorded, so that the measured runs find the compile
    caches (torch.compile's of Megatron's fused functions, Triton's, TE's) as a training run
    finds them after its first minutes: a first run on a fresh machine measured 13,378 tokens/s
    where the same run repeated measured 17,228. ``providers`` / ``repeats``: ``plan_runs``.
    """
    budget = _Budget(budget_s, run_timeout_s, clock)
    rows: list[dict] = []
    all_ok = True
    if profile_busy:
        profile_steps = profile_busy_steps(steps)
    for shape in shapes:
        plans = plan_runs(shape, gpus=gpus, steps=steps, seed=seed, noise_run=noise_run,
                          regime=regime, providers=providers, repeats=repeats)  # fmt: skip
        with_providers = shape_providers(shape, providers) is not None
        results: dict[str, RunResult] = {}
        profiles: dict[str, dict] = {}
        warm = plan_runs(shape, gpus=gpus, steps=warm_up_steps, seed=seed, noise_run=False,
                         regime=regime, providers=providers) if warm_up_steps else []  # fmt: skip
        for p in warm:
            _, timeout = budget.next_run()
            if timeout is None:
                print(f"[bench_e2e] {shape.name} warm-up {p.label}: not started", flush=True)
                continue
            r = runner(list(p.flags), gpus=gpus, label=f"warm_up_{p.label}", timeout_s=timeout)
            why = r.failure(warm_up_steps)
            print(f"[bench_e2e] {shape.name} warm-up {p.label}: "
                  + ("ok" if why is None else f"FAILED ({why})") + f", {r.seconds:.1f} s",
                  flush=True)  # fmt: skip
        for p in plans:
            left, timeout = budget.next_run()
            if timeout is None:
                r = RunResult(
                    p.dispatcher,
                    -1,
                    label=p.label,
                    command=" ".join(shlex.quote(f) for f in p.flags),
                    note=f"not started: {max(left, 0):.0f} s of --budget-s {budget_s:.0f} left",
                )
            else:
                print(f"[bench_e2e] {shape.name} {p.label}: starting", flush=True)
                profiled = (
                    profile_busy or p.label in PROFILED_LABELS or (with_providers and not p.noise)
                )
                if profile_steps is not None and profiled:
                    workdir = tempfile.mkdtemp(prefix=f"relaymoe_e2e_prof_{p.label}_")
                    r = runner([*p.flags, *profile_flags(profile_steps, workdir)], gpus=gpus,
                               label=p.label, timeout_s=timeout, workdir=workdir)  # fmt: skip
                    profiles[p.label] = profile_row(shape, p, workdir, profile_steps)
                    writer.write(profiles[p.label])
                else:
                    r = runner(list(p.flags), gpus=gpus, label=p.label, timeout_s=timeout)
            why = r.failure(steps)
            skip = profiler_slowed_steps(profile_steps) if p.label in profiles else ()
            tps = r.tokens_per_s(exclude=skip) if why is None else None
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
        kw = dict(gpus=gpus, steps=steps, seed=seed, warm_up_steps=warm_up_steps,
                  profiles=profiles)  # fmt: skip
        if with_providers:
            new = provider_rows(plans, results, **kw)
            for row in new:
                print(f"{row['label']}: {_num(row['tokens_per_s'])} tokens/s, "
                      f"x{_num(row['speedup_vs_anchor'])} of {row['anchor_provider']}, "
                      f"{_num(row['model_tflops_per_gpu'])} TFLOP/s a GPU, graphs "
                      f"{row['cuda_graph_impl']}, tokens dropped {row['tokens_dropped']}, "
                      f"max |loss - anchor| {_num(row['max_abs_loss_diff_vs_anchor'])}",
                      flush=True)  # fmt: skip
        else:
            new = shape_rows(plans, results, **kw)
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


TOKENS_WARMUP_STEPS = 5  # RunResult.tokens_per_s's default: steps left out of the median


def profile_busy_steps(steps: int) -> tuple[int, int]:
    """``(START, END)`` of the one step ``--profile-busy`` profiles: the second-last, after the
    tokens/s warm-up and the whole-iteration graph's capture (``GRAPH_WARMUP_STEPS``)."""
    start = steps - 1
    if start - 1 <= max(TOKENS_WARMUP_STEPS, GRAPH_WARMUP_STEPS + 1):
        raise ValueError(
            f"--profile-busy profiles step {start} of {steps}: train at least "
            f"{max(TOKENS_WARMUP_STEPS, GRAPH_WARMUP_STEPS + 1) + 3} steps"
        )
    return start, start + 1


def profiler_slowed_steps(steps: tuple[int, int]) -> set[int]:
    """The 1-based steps of a run that Megatron's torch profiler over ``steps = (START, END)``
    slows: its warm-up step (START - 1: the profiler runs, its trace is dropped) and the active
    steps START..END-1 (Megatron calls ``prof.step()`` at the start of each iteration)."""
    start, end = steps
    return set(range(max(start - 1, 1), end))


def _profiled_steps(profiles: dict[str, dict]) -> dict[str, set[int]]:
    """label -> the steps its profiler slowed, for the runs that were profiled."""
    return {label: profiler_slowed_steps(tuple(row["profile_steps"]))
            for label, row in profiles.items()}  # fmt: skip


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
           "provider": plan.provider or _provider(plan.dispatcher, shape),
           "repeat": plan.repeat, "cuda_graph_impl": cuda_graph_impl(plan.flags),
           "profile_steps": list(steps), "flags": list(plan.flags)}  # fmt: skip
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
    candidates: tuple[str, ...] | None = None,
) -> list[tuple[str, tuple[str, ...]]]:
    """The anchor sweep of one anchor shape: ``(label, flags)`` of its alltoall run as it is
    (``base``), then with each of ``candidates`` (names of ``ANCHOR_CANDIDATES``; None: all)
    added alone, then ``base`` again (the drift of the machine over the sweep)."""
    if not shape.anchor:
        raise ValueError(f"--anchor-sweep needs an anchor shape (with '_te'), got {shape.name!r}")
    names = tuple(ANCHOR_CANDIDATES) if candidates is None else tuple(candidates)
    unknown = [n for n in names if n not in ANCHOR_CANDIDATES]
    if unknown or not names:
        raise ValueError(f"--sweep-candidates {list(names)}: unknown {unknown}; name one or more "
                         f"of {sorted(ANCHOR_CANDIDATES)}")  # fmt: skip
    flags = provider_run_flags(shape, ANCHOR_PROVIDER, gpus=gpus, steps=steps, seed=seed,
                               regime=regime or shape.regime, check_te=check_te)  # fmt: skip
    out = [("base", flags)]
    for name in names:
        extra = ANCHOR_CANDIDATES[name][0]
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
    candidates: tuple[str, ...] | None = None,
) -> list[dict]:
    """Time megatron-core's alltoall with each candidate option alone (``sweep_plans``); one row
    ``bench: e2e_anchor_sweep`` per run, with ``speedup_vs_base`` (tokens/s over the first base
    run's). A candidate that fails or is not faster than both base runs is not kept."""
    budget = _Budget(budget_s, run_timeout_s, clock)
    rows: list[dict] = []
    base_tps = None
    for label, flags in sweep_plans(shape, gpus=gpus, steps=steps, seed=seed, regime=regime,
                                    candidates=candidates):  # fmt: skip
        left, timeout = budget.next_run()
        if timeout is None:
            r = RunResult("alltoall", -1, label=label, note=f"not started: {left:.0f} s left")
        else:
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
        "--sweep-candidates",
        nargs="+",
        default=None,
        metavar="NAME",
        help="with --anchor-sweep: only these ANCHOR_CANDIDATES (default: all)",
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
    p.add_argument(
        "--profile-busy",
        action="store_true",
        help="every run torch-profiles one step after its warm-up (the second-last); its row "
        "carries gpu_busy_frac, the step left out of tokens/s (and an e2e_profile row)",
    )
    p.add_argument(
        "--providers",
        default=None,
        help=f"comma-separated providers of every shape's runs: {', '.join(PROVIDERS)} "
        "(default: the shape's own; the gbs shapes run GBS_PROVIDERS, every one but "
        "mcore_alltoall, the others ring and alltoall)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with providers: run the provider list this many times in order (interleaved "
        "runs; rows carry the pass as repeat)",
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
    providers = [x.strip() for x in a.providers.split(",") if x.strip()] if a.providers else None
    try:  # bad combinations (e.g. fewer steps than the warm-up) before any GPU time is spent
        planned = [
            plan_runs(s, gpus=gpus, steps=steps, seed=a.seed, noise_run=a.noise_run,
                      regime=a.regime, check_te=check_te, providers=providers,
                      repeats=a.repeats)
            for s in shapes
        ]  # fmt: skip
        if a.profile_busy and a.profile_steps:
            raise ValueError("--profile-busy and --profile-steps exclude each other")
        if a.profile_busy:
            profile_busy_steps(steps)
        sweeps = [
            sweep_plans(s, gpus=gpus, steps=steps, seed=a.seed, regime=a.regime,
                        check_te=check_te, candidates=a.sweep_candidates)
            for s in shapes
        ] if a.anchor_sweep else []  # fmt: skip
        if a.warm_up_steps:
            for s in shapes:
                plan_runs(s, gpus=gpus, steps=a.warm_up_steps, seed=a.seed, noise_run=False,
                          regime=a.regime, check_te=check_te, providers=providers)  # fmt: skip
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
                if shape_providers(r.shape, providers) is None:
                    print(f"# {r.shape.name} {r.label} (regime {r.regime}, EP={ep})")
                else:
                    b = batch_fields(r.flags, gpus)
                    print(f"# {r.shape.name} {r.label} (provider {r.provider}, repeat "
                          f"{r.repeat}, regime {r.regime}, EP={ep}, global batch {b['gbs']} = "
                          f"{b['micro_batches']} micro-batches a rank, CUDA graphs "
                          f"{cuda_graph_impl(r.flags)}, tokens dropped "
                          f"{tokens_dropped(r.flags)})")  # fmt: skip
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
                                    run_timeout_s=a.run_timeout_s,
                                    candidates=a.sweep_candidates)  # fmt: skip
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
        providers=providers,
        repeats=a.repeats,
        profile_busy=a.profile_busy,
    )
    print(f"rows appended to {a.out}; {time.perf_counter() - t0:.0f} s in all")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
