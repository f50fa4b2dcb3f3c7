"""The longest sequence that trains, measured: a bisection over separate Megatron runs.

    python benchmarks/max_seq.py [--providers mcore_alltoall,relaymoe_ring,relaymoe_ring_fused_loss]
        [--policies full[,selective,none]] [--config qwen3_slice_v152k] [--gpus 2] [--lanes 1]
        [--budget-s 14400] [--search-budget-s S] [--max-trial-s 1200] [--memory-cap GPU]
        [--anchor-rows ROWS.jsonl] [--out benchmarks/results/max_seq.jsonl] [--dry-run]

Model: ``configs/qwen3_slice_v152k.yaml`` (4 layers of Qwen3-30B-A3B with its 151,936-token
vocabulary) at EP = data-parallel size = ``--gpus``, micro-batch 1, bf16, mock data.

Providers (``PROVIDERS``): ``mcore_alltoall`` (megatron-core's alltoall dispatcher),
``relaymoe_ring`` (``--moe-token-dispatcher-type ring``, ring mode auto),
``relaymoe_ring_fused_loss`` (the ring + ``--relaymoe-fused-loss``), ``mcore_alltoall_fused_loss``
on request: each with TransformerEngine where it imports, else megatron-core's local layers with
the SDPA attention below. And with TransformerEngine always (``--transformer-impl
transformer_engine``; a ``ValueError`` where TE does not import): ``mcore_alltoall_te`` and
``relaymoe_ring_te`` with megatron-core's fused cross-entropy (``--cross-entropy-loss-fusion
--cross-entropy-fusion-impl native``, how a user runs megatron-core: the loss held equal
between the two), ``mcore_alltoall_te_fused_loss`` and ``relaymoe_ring_te_fused_loss`` with
relaymoe's fused output layer + loss (our loss with their dispatcher, and with ours).

Recompute policies (``--policies``; ``relaymoe.planner.policies``, which also gives
``relaymoe plan``'s predictions, holds their flags): ``full`` (every layer, uniform, one layer a
checkpoint), ``selective`` (megatron-core's memory set for alltoall, ``--recompute-granularity
selective --recompute-modules moe_act layernorm core_attn moe`` with no offloading, which
megatron-core 0.19 refuses beside ``moe``: that module's docstring says why; for the ring the
recompute plan ``relaymoe plan`` prints for the GPU at the trial's sequence, from
``relaymoe.planner.plan``), ``none`` (no recompute). Each provider x policy is a job: one search.

Attention: without TransformerEngine megatron-core's local attention keeps (heads, s, s) scores
and would bind long before the MoE block or the loss. Each such trial therefore passes
``--spec benchmarks.sdpa_attention sdpa_decoder_spec --no-create-attention-mask-in-dataloader``
(Megatron's own spec hook; ``benchmarks/sdpa_attention.py``): causal GQA flash attention through
SDPA, O(s) memory like TE's. A trial whose log lacks the spec's marker is an error, not data.
With TransformerEngine its attention is used as it is.

Allocator: every trial runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
(``--alloc-conf``; '' for the default), for all providers alike: the planner models no
fragmentation. ``--memory-cap GPU`` emulates a smaller GPU (e.g. ``h100-80gb``): each trial's
allocator is capped at the planner's usable bytes of that GPU (``benchmarks/capped_pretrain.py``,
whose marker the log must carry) and the planner plans for it; rows say ``memory_cap_gpu`` /
``memory_cap_bytes``. That is how a provider whose longest sequence on the whole GPU would take
longer than a trial can run (attention is O(s^2)) is still bisected, and how an H200 gives an
H100's rows.

Search, per job: every trial is one ``torchrun -m relaymoe.megatron.pretrain`` job of
``--steps`` (2) training steps in its own process group and folder (logs kept there). A trial is
``ok`` (all steps, finite losses), ``oom`` (CUDA out-of-memory text in the log, whichever rank),
``timeout`` (no result within ``--max-trial-s``: an upper bound for the search, but not an OOM),
``budget`` (cut by ``--budget-s``) or ``error`` (anything else: the search stops and shows it).
The first trial is the planner's prediction rounded down to ``--step`` (4096); then the bracket
grows (after a success) or shrinks (after a failure) geometrically, by ``--growth`` (1/8), 1/4,
1/2, 1, ... of the sequence, and is bisected to one step. ``--budget-s`` bounds the whole
invocation; each search gets the time left times the lanes divided by the searches left (at
most ``--search-budget-s``), and a trial is started only if its estimated time (at least
``--min-trial-s``) fits. Trial time is estimated from FLOPs (attention is O(s^2)) under the
job's policy and calibrated on each completed trial's last step; each estimate is printed.
Leftover worker processes are killed by pid after every trial, and a trial does not start while
another process holds its GPUs' memory.

Lanes (``--lanes N``, ``all``: every GPU of the machine over ``--gpus``): N jobs at once, each
trial of a lane pinned to its GPUs by ``CUDA_VISIBLE_DEVICES`` (one-GPU jobs on an 8-GPU host:
eight searches side by side, the anchors first). Jobs on one host do not share a GPU; they share
its CPUs, which the trials barely use.

The anchor of a provider is ``mcore_alltoall_te`` under the same policy (``mcore_alltoall`` for
the providers without forced TE). Once a job's search and its anchor's are done, the job runs a
second, timed trial at the anchor's longest sequence (or reuses a trial of its search at exactly
that length) for ``tokens_per_s_at_anchor_seq``; an anchor not among the providers is read from
``--anchor-rows`` (an earlier run's rows, same config, GPUs and cap).

Memory breakdown: every trial runs with ``--relaymoe-memory-phases``
(``relaymoe/megatron/memory_phases.py``): rank 0 writes, in each step's report line, where the
step's peak fell and its terms (model states, retained activations, the transient at the
peak). The row carries the last step's at the longest sequence (``measured_breakdown``) beside
the planner's at the same length and policy (``planner_breakdown_at_max_seq``, the same names:
``relaymoe.planner.recompute.comparable_terms``), and each one's ``binding_term``.

Rows ``bench: max_seq`` (one per job, appended to ``--out`` as each job finishes): ``provider``,
``recompute_policy``, ``flags`` (the Megatron flags of the trial at the longest sequence, or of
the first trial), ``transformer_impl``, ``ce_fusion``, ``shape``, ``config``, ``ep``, ``gpus``,
``max_seq`` (largest sequence that trained; 0 if none), ``first_oom_seq`` (smallest that ran out
of memory), ``upper_seq`` / ``upper_reason`` (smallest failed trial, OOM or timeout),
``bracket_open`` (true: ``max_seq`` is only a lower bound: budget, timeout bound, error or
sequence limit), ``stop_reason``, ``trials`` (each ``seq``, ``ok``, ``reason``, ``wall_s``,
``peak_MiB`` (max_memory_allocated of rank 0, the largest step), ``tokens_per_s`` (the last
step's), ``memory`` (the last step's memory phases), ``recompute`` (the trial's recompute
flags), ``megatron_max_allocated_MB`` / ``megatron_max_reserved_MB`` (Megatron's memory report
after step 1), ``est_s``, ``timeout_s``, ``detail``, ``log_dir``), ``peak_MiB_at_max_seq``,
``tokens_per_s_at_max_seq``, ``anchor``, ``anchor_max_seq``, ``tokens_per_s_at_anchor_seq``,
``anchor_seq_trial``, ``anchor_seq_note``, ``measured_breakdown``, ``binding_term``,
``planner_breakdown_at_max_seq``, ``planner_binding_term``, ``predicted_max_seq`` (the planner's,
for the same model, parallelism, policy and TE at the GPU's total memory from
``torch.cuda.mem_get_info``, or the cap's GPU), ``predicted_over_measured``,
``planner_peak_at_max_seq_MiB``, ``planner_breakdown_at_predicted``, ``planner_gpu_bytes``,
``gpu_total_bytes``, ``gpu_free_bytes``, ``lane``, the run settings, and ``gpu``, ``commit``,
``torch``, ``triton``, ``command``, ``date``. ``--dry-run`` prints the predictions and the trial
plan (commands included) without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, JsonlWriter, environment  # noqa: E402
from benchmarks.e2e import TE_IMPL, RunResult, have_te, pretrain_args  # noqa: E402
from benchmarks.lanes import LaneQueue, lane_devices  # noqa: E402
from benchmarks.processes import descendants, kill_leftovers, stop_group  # noqa: E402
from relaymoe.config import flag_groups  # noqa: E402
from relaymoe.planner.policies import (  # noqa: E402
    MCORE_FUSED_CE_FLAGS,
    POLICIES,
    RECOMPUTE_FLAGS,
    policy_flags,
)

DEFAULT_CONFIG = "qwen3_slice_v152k"
SEQ_STEP = 4096
SEQ_LIMIT = 1 << 21  # 2M tokens: far beyond what one H200 trains here (and hours of attention)
STEPS = 2
GROWTH0 = 0.125  # first bracket move: 1/8 of the sequence, doubling each further move
MIN_TRIAL_S = 90.0  # no trial starts with less budget left (start-up alone is ~40-60 s)
DEFAULT_GPU = "h200-141gb"  # --dry-run without --gpu-bytes
SPEC_FLAGS = ("--spec", "benchmarks.sdpa_attention", "sdpa_decoder_spec")
SDPA_MARKER = "[sdpa_attention] core attention replaced by SdpaCoreAttention"  # its MARKER
GPU_BUSY_MIB = 2048  # another process holding more than this on a trial's GPU: do not start
# The trials' PYTORCH_CUDA_ALLOC_CONF (--alloc-conf): without expandable segments a 46-67 GiB
# fp32 logits block of Megatron's cross-entropy found 36-58 GiB reserved but unusable in the
# second step (megatron-core out of memory at 81,920 tokens with a 65,536-token peak of 87 GiB,
# commit e3bbf85); the planner models no fragmentation. PyTorch's own out-of-memory message
# advises this setting.
ALLOC_CONF = "expandable_segments:True"
CAPPED_MODULE = "benchmarks.capped_pretrain"
MEMORY_PHASES_FLAG = "--relaymoe-memory-phases"  # relaymoe.megatron.pretrain's, every trial


@dataclass(frozen=True)
class Provider:
    name: str
    dispatcher: str  # --moe-token-dispatcher-type
    fused_loss: bool  # --relaymoe-fused-loss
    variant: str  # the planner's name (relaymoe.planner.plan.VARIANTS)
    transformer_impl: str | None = None  # None: TE where it imports, else local + SDPA
    ce_fusion: bool = False  # megatron-core's fused cross-entropy (MCORE_FUSED_CE_FLAGS)

    @property
    def anchor(self) -> str:
        """The provider whose longest sequence (same policy) this one is also timed at."""
        return ANCHOR_TE if self.transformer_impl == TE_IMPL else ANCHOR


ANCHOR, ANCHOR_TE = "mcore_alltoall", "mcore_alltoall_te"
PROVIDERS = {
    p.name: p
    for p in (
        Provider("mcore_alltoall", "alltoall", False, "alltoall"),
        Provider("relaymoe_ring", "ring", False, "ring"),
        Provider("relaymoe_ring_fused_loss", "ring", True, "ring_fused_loss"),
        Provider("mcore_alltoall_fused_loss", "alltoall", True, "alltoall_fused_loss"),
        Provider(ANCHOR_TE, "alltoall", False, "alltoall", TE_IMPL, ce_fusion=True),
        Provider("mcore_alltoall_te_fused_loss", "alltoall", True, "alltoall_fused_loss", TE_IMPL),
        Provider("relaymoe_ring_te", "ring", False, "ring", TE_IMPL, ce_fusion=True),
        Provider("relaymoe_ring_te_fused_loss", "ring", True, "ring_fused_loss", TE_IMPL),
    )
}
DEFAULT_PROVIDERS = ("mcore_alltoall", "relaymoe_ring", "relaymoe_ring_fused_loss")
TE_PROVIDERS = (
    ANCHOR_TE,
    "mcore_alltoall_te_fused_loss",
    "relaymoe_ring_te",
    "relaymoe_ring_te_fused_loss",
)


@dataclass(frozen=True)
class Job:
    """One search: a provider (``PROVIDERS``' key) under a recompute policy (``POLICIES``),
    with the name its logs and rows give it and its trials' folder."""

    provider: str
    policy: str

    @property
    def name(self) -> str:
        return f"{self.provider}/{self.policy}"

    @property
    def folder(self) -> str:
        return f"{self.provider}_{self.policy}"

    @property
    def anchor(self) -> Job:
        return Job(PROVIDERS[self.provider].anchor, self.policy)


def jobs_of(providers, policies) -> list[Job]:
    """Every provider under every policy, the anchors first (the others are timed at their
    anchor's longest sequence), then policy by policy in the order given."""
    jobs = [Job(p, policy) for policy in policies for p in providers]
    return sorted(jobs, key=lambda j: j.anchor != j)


# -- flags and the planner -----------------------------------------------------------------


def uses_te(transformer_impl: str | None) -> bool:
    """Whether a provider's trials run TransformerEngine (None: where it imports)."""
    return transformer_impl == TE_IMPL or (transformer_impl is None and have_te())


def attention_flags(transformer_impl: str | None = None) -> list[str]:
    """The SDPA substitution (without TransformerEngine), and never a (b, 1, s, s) mask."""
    flags = [] if uses_te(transformer_impl) else list(SPEC_FLAGS)
    return flags + ["--no-create-attention-mask-in-dataloader"]


def with_recompute(flags: list[str], recompute: list[str]) -> list[str]:
    """``flags`` with every recompute flag (``policies.RECOMPUTE_FLAGS``) replaced by
    ``recompute``, appended."""
    kept = [g for g in flag_groups(flags) if g[0] not in RECOMPUTE_FLAGS]
    return [w for g in kept for w in g] + list(recompute)


def ring_plan_flags(config: str, provider: str, seq: int, *, gpus: int, gpu_bytes: int) -> list:
    """The recompute flags ``relaymoe plan`` prints for the ring provider at ``seq`` on a GPU of
    ``gpu_bytes`` (``Plan.planned_recompute_flags``); full recompute where even that does not
    fit (the plan then refuses)."""
    from relaymoe.planner import plan

    p = PROVIDERS[provider]
    cfg = planner_config(config, gpus, provider).replace(
        training={"seq_length": seq}, relaymoe={"dispatcher": "ring", "fused_loss": p.fused_loss}
    )
    try:
        return list(plan(cfg, gpu_bytes).planned_recompute_flags)
    except ValueError:
        return policy_flags("full", "ring")


def recompute_flags(
    config: str, provider: str, policy: str, seq: int, *, gpus: int, gpu_bytes: int | None
) -> list[str]:
    """The recompute flags of ``provider`` under ``policy`` at ``seq`` (``policies.policy_flags``;
    the ring's selective policy is the plan for ``gpu_bytes``, which it then needs)."""
    p = PROVIDERS[provider]
    planned = None
    if policy == "selective" and p.dispatcher == "ring":
        if gpu_bytes is None:
            raise ValueError(
                f"{provider} under the selective policy runs the recompute plan for the GPU: "
                "give its memory (--gpu-bytes or --memory-cap; a GPU run reads it)"
            )
        planned = ring_plan_flags(config, provider, seq, gpus=gpus, gpu_bytes=gpu_bytes)
    return policy_flags(policy, p.dispatcher, planned)


def trial_flags(
    config: str,
    provider: str,
    seq: int,
    *,
    gpus: int,
    steps: int = STEPS,
    seed: int = 1234,
    policy: str = "full",
    gpu_bytes: int | None = None,
    check_te: bool = True,
) -> list[str]:
    """Megatron flags of one trial: ``config`` at sequence ``seq``, micro-batch 1, EP = ``gpus``,
    the provider's dispatcher, loss and layers (the SDPA attention without TE), and ``policy``'s
    recompute flags in place of the config's. ``check_te=False``: TE providers' flags where TE
    does not import (a dry run's)."""
    p = PROVIDERS[provider]
    extra = attention_flags(p.transformer_impl)
    extra += ["--relaymoe-fused-loss"] if p.fused_loss else []
    extra += list(MCORE_FUSED_CE_FLAGS) if p.ce_fusion else []
    # regime "launcher": its warm-up fits 2 steps; the learning rate does not change memory
    flags = pretrain_args(
        config,
        gpus=gpus,
        steps=steps,
        dispatcher=p.dispatcher,
        seed=seed,
        extra=extra,
        seq_length=seq,
        micro_batch_size=1,
        regime="launcher",
        transformer_impl=p.transformer_impl,
        check_te=check_te,
    )
    rc = recompute_flags(config, provider, policy, seq, gpus=gpus, gpu_bytes=gpu_bytes)
    return with_recompute(flags, rc)


def normalization_impl(provider: str | None = None) -> str:
    """How these runs normalise (``relaymoe.planner.plan.normalization_impl_of`` for
    ``pretrain_args``' flags): TE's fused norms (a TE provider, or any where TE imports), else
    ``--transformer-impl local`` with apex's (fused) or megatron-core's torch fallback ("torch"
    where torch has its fused RMSNorm kernel, else "torch_composite")."""
    import importlib.util

    impl = PROVIDERS[provider].transformer_impl if provider else None
    if uses_te(impl) or importlib.util.find_spec("apex") is not None:
        return "fused"
    from benchmarks.common import torch_norm_impl

    return torch_norm_impl()


def planner_config(config: str, gpus: int, provider: str | None = None):
    """The planner's view of ``provider``'s trials: the config at EP = DP = ``gpus``,
    micro-batch 1, the provider's normalisation on this machine."""
    from relaymoe.config import load_config

    cfg = load_config(config)
    return cfg.replace(
        parallel={"ep": gpus, "dp": gpus},
        training={
            "micro_batch_size": 1,
            "global_batch_size": None,
            "normalization_impl": normalization_impl(provider),
        },
    )


def planner_impl(provider: str) -> str:
    """The ``transformer_impl`` the planner predicts ``provider``'s trials with."""
    from relaymoe.planner.memory import LOCAL_IMPL

    return TE_IMPL if uses_te(PROVIDERS[provider].transformer_impl) else LOCAL_IMPL


@dataclass(frozen=True)
class Prediction:
    gpu_bytes: int
    usable_bytes: int
    max_seq: dict  # Job -> planner's longest sequence under its policy
    breakdown: dict  # Job -> {"seq", "terms" (comparable), "binding_term"} there, or None


def predict(config: str, gpus: int, gpu_bytes: int, jobs) -> Prediction:
    """The planner's longest sequence of each job (``relaymoe.planner.plan.policy_max_seq``)
    on a GPU of ``gpu_bytes``, and its breakdown there."""
    from relaymoe.planner.plan import parse_gpu, policy_max_seq, usable_bytes

    gpu = parse_gpu(gpu_bytes)
    usable = usable_bytes(gpu)
    max_seq, breakdown = {}, {}
    for job in jobs:
        p = PROVIDERS[job.provider]
        cfg = planner_config(config, gpus, job.provider)
        n = policy_max_seq(
            cfg, p.dispatcher, job.policy, usable, fused_loss=p.fused_loss,
            transformer_impl=planner_impl(job.provider),
        )  # fmt: skip
        max_seq[job] = n
        breakdown[job] = planner_breakdown(config, gpus, job, n, usable) if n else None
    return Prediction(gpu, usable, max_seq, breakdown)


def planner_breakdown(config: str, gpus: int, job: Job, seq: int, usable: int) -> dict | None:
    """The planner's peak of ``job`` at ``seq`` (its policy, TE or not) in the measured
    breakdown's names (``recompute.comparable_terms``), its ``total`` and ``binding_term``;
    None where the policy's plan does not fit at all."""
    from relaymoe.planner.policies import policy_peak
    from relaymoe.planner.recompute import binding_term, comparable_terms

    p = PROVIDERS[job.provider]
    pk = policy_peak(
        planner_config(config, gpus, job.provider), p.dispatcher, job.policy, usable=usable,
        seq=seq, fused_loss=p.fused_loss, transformer_impl=planner_impl(job.provider),
    )  # fmt: skip
    if pk is None:
        return None
    terms = comparable_terms(pk.terms)
    return {"seq": seq, "total": pk.total, "terms": terms, "binding_term": binding_term(terms)}


# -- trial time --------------------------------------------------------------------------------

STARTUP_S = 60.0  # torchrun + Megatron init + model build, before the first step
ATTN_FLOPS_PER_S = 250e12  # SDPA flash on an H200, bf16 causal, forward + backward averaged
OTHER_FLOPS_PER_S = 100e12  # projections, experts, loss: smaller GEMMs, dispatch included
STEP_FIXED_S = 2.0  # optimizer step, gradient reductions
# passes of each part over a step, per recompute policy: (attention core, projections, MoE):
# forward 1, backward 2 (flash attention's 2.5), and a recomputed part's forward again
POLICY_PASSES = {
    "full": (4.5, 4.0, 4.0),
    "selective": (4.5, 3.0, 4.0),  # megatron-core's set: core attention and the MoE again
    "none": (3.5, 3.0, 3.0),
}


@dataclass
class TimeModel:
    """Seconds of a trial: start-up + steps x (attention FLOPs / rate + other FLOPs / rate),
    scaled by the last completed trial (its last step's time over the model's)."""

    cfg: object  # relaymoe.config.Config
    steps: int = STEPS
    startup_s: float = STARTUP_S
    scale: float = 1.0
    calibrated_at: int | None = None  # the sequence of the trial it was calibrated on
    policy: str = "full"  # the recompute policy (POLICY_PASSES)

    def step_flops(self, seq: int) -> tuple[float, float]:
        """(attention core, everything else) FLOPs of one step on one GPU: each part's forward
        times its passes under the policy (``POLICY_PASSES``: full recompute runs the layers
        forward twice and backward, 2x, flash attention's 2.5x); the output layer forward and
        backward."""
        m = self.cfg.model
        h, d, nh, ng = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups
        t = seq  # micro-batch 1, no CP/TP
        core_fwd = 2.0 * t * seq * nh * d  # QK^T and PV over the causal half
        proj = 2.0 * t * h * (nh + 2 * ng) * d + 2.0 * t * nh * d * h
        moe = (
            2.0 * t * m.moe_router_topk * h * 3 * m.moe_ffn_hidden_size
            + 2.0 * t * h * m.num_experts
        )
        layers = m.num_layers
        a_pass, p_pass, m_pass = POLICY_PASSES[self.policy]
        attn = layers * a_pass * core_fwd
        other = layers * (p_pass * proj + m_pass * moe) + 3.0 * 2.0 * t * h * m.vocab_size
        return attn, other

    def raw_step_s(self, seq: int) -> float:
        attn, other = self.step_flops(seq)
        return attn / ATTN_FLOPS_PER_S + other / OTHER_FLOPS_PER_S + STEP_FIXED_S

    def step_s(self, seq: int) -> float:
        return self.scale * self.raw_step_s(seq)

    def trial_s(self, seq: int) -> float:
        return self.startup_s + self.steps * self.step_s(seq)

    def calibrate(self, seq: int, last_step_s: float, wall_s: float) -> None:
        self.scale = last_step_s / self.raw_step_s(seq)
        # step 1's one-off warm-up lands in the start-up, where every trial pays it
        self.startup_s = max(10.0, wall_s - self.steps * last_step_s)
        self.calibrated_at = seq


# -- one trial ---------------------------------------------------------------------------------

REASONS = ("ok", "oom", "timeout", "budget", "error")
OOM_PATTERNS = (
    r"torch\.(?:cuda\.)?OutOfMemoryError",
    r"CUDA out of memory",
    r"CUDA (?:driver )?error: out of memory",
    r"\[CUDA\]: out of memory",  # Triton's launcher
    r"CUBLAS_STATUS_ALLOC_FAILED",
    r"Cuda failure[^\n]*out of memory",
    r"cudaErrorMemoryAllocation",
)
_OOM_RE = re.compile("|".join(OOM_PATTERNS))
_MEGATRON_MEM_RE = re.compile(
    r"memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+) \| "
    r"reserved: ([\d.]+) \| max reserved: ([\d.]+)"
)
_SIZE = r"([\d.]+) (GiB|MiB|KiB|bytes)"
_UNITS = {"GiB": 1024.0, "MiB": 1.0, "KiB": 1 / 1024, "bytes": 1 / 2**20}


@dataclass(frozen=True)
class Trial:
    seq: int
    reason: str  # ok | oom | timeout | budget | error
    wall_s: float
    peak_MiB: float | None = None  # rank 0's max_memory_allocated, largest step
    detail: str = ""  # the OOM line, the timeout, or the error's log tail
    step_s: tuple[float, ...] = ()
    megatron_max_allocated_MB: float | None = None
    megatron_max_reserved_MB: float | None = None
    oom_request_MiB: float | None = None  # "Tried to allocate ..."
    oom_allocated_MiB: float | None = None  # "... is allocated by PyTorch"
    est_s: float | None = None
    timeout_s: float | None = None
    log_dir: str = ""
    tokens_per_s: float | None = None  # the last step's (the report's: world tokens / step)
    memory: dict | None = None  # the last step's memory phases (relaymoe.megatron.memory_phases)
    recompute: tuple[str, ...] = ()  # the trial's recompute flags (its policy's)

    def __post_init__(self):
        if self.reason not in REASONS:
            raise ValueError(f"trial reason {self.reason!r}; known: {REASONS}")

    @property
    def ok(self) -> bool:
        return self.reason == "ok"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["step_s"] = list(self.step_s)
        d["recompute"] = list(self.recompute)
        return {"seq": self.seq, "ok": self.ok, **{k: v for k, v in d.items() if k != "seq"}}


def oom_line(log: str) -> str | None:
    """The first line of ``log`` that reports a CUDA out-of-memory (any rank), or None."""
    m = _OOM_RE.search(log)
    if m is None:
        return None
    start = log.rfind("\n", 0, m.start()) + 1
    end = log.find("\n", m.end())
    return log[start : end if end >= 0 else len(log)].strip()[:600]


def _mib(m: re.Match | None) -> float | None:
    return None if m is None else float(m.group(1)) * _UNITS[m.group(2)]


def classify(
    *,
    returncode: int,
    timed_out: bool,
    timeout_s: float,
    steps: list[dict],
    log: str,
    expected_steps: int,
    marker: str | tuple[str, ...] | None,
) -> tuple[str, str]:
    """(reason, detail) of a finished job.

    ``ok``: every step reported a finite loss (rank 0 reports a step only after both ranks'
    gradients met in it), and the log has ``marker`` when one is given; an exit status or a
    hang after the last step is noted in the detail. Else ``oom`` when the log has CUDA
    out-of-memory text (also if the job then hung until its timeout), else ``timeout``, else
    ``error`` with the log's tail (a non-finite loss is an error too).
    """
    losses = [s.get("loss") for s in steps]
    finite = all(isinstance(x, int | float) and math.isfinite(x) for x in losses)
    if len(steps) >= expected_steps and finite:
        markers = (marker,) if isinstance(marker, str) else tuple(marker or ())
        missing = [m for m in markers if m not in log]
        if missing:
            return "error", (
                f"the run trained but its log lacks {missing[0]!r}: the --spec import or the "
                "allocator cap did not take effect (see the log)"
            )
        if timed_out:
            return "ok", "all steps trained, then the job hung until its timeout"
        return "ok", "" if returncode == 0 else f"all steps trained, then exit status {returncode}"
    tail = "\n".join(log.rstrip().splitlines()[-40:])
    if not finite:
        return "error", f"non-finite loss {losses}; log tail:\n{tail}"
    oom = oom_line(log)
    if oom is not None:
        return "oom", oom + (" (then hung until the timeout)" if timed_out else "")
    if timed_out:
        return "timeout", f"no result within {timeout_s:.0f} s ({len(steps)} steps reported)"
    run = RunResult("?", returncode, steps=list(steps))
    why = run.failure(expected_steps) or f"exit status {returncode}"
    return "error", f"{why}; log tail:\n{tail}"


def trial_from_log(
    seq: int,
    *,
    returncode: int,
    timed_out: bool,
    timeout_s: float,
    wall_s: float,
    steps: list[dict],
    log: str,
    expected_steps: int,
    marker: str | tuple[str, ...] | None,
    log_dir: str = "",
) -> Trial:
    reason, detail = classify(
        returncode=returncode, timed_out=timed_out, timeout_s=timeout_s, steps=steps, log=log,
        expected_steps=expected_steps, marker=marker,
    )  # fmt: skip
    mem = _MEGATRON_MEM_RE.findall(log)
    peaks = [s["peak_MiB"] for s in steps if s.get("peak_MiB") is not None]
    oom = reason == "oom"
    return Trial(
        seq=seq,
        reason=reason,
        wall_s=wall_s,
        peak_MiB=max(peaks) if peaks else None,
        detail=detail,
        step_s=tuple(float(s["step_s"]) for s in steps if "step_s" in s),
        megatron_max_allocated_MB=max(float(x[1]) for x in mem) if mem else None,
        megatron_max_reserved_MB=max(float(x[3]) for x in mem) if mem else None,
        oom_request_MiB=_mib(re.search("Tried to allocate " + _SIZE, log) if oom else None),
        oom_allocated_MiB=_mib(re.search(_SIZE + " is allocated by PyTorch", log) if oom else None),
        log_dir=log_dir,
        tokens_per_s=steps[-1].get("tokens_per_s") if steps else None,
        memory=steps[-1].get("memory_phases") if steps else None,
    )


def gpu_memory_used_mib() -> list[float] | None:
    """Memory used on each GPU by any process (nvidia-smi; None when it is not there)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return None
    return [float(x) for x in out.split() if x.strip()]


def wait_gpus_free(
    gpus: int, *, wait_s: float = 60.0, probe=gpu_memory_used_mib, devices=None
) -> str | None:
    """None once the trial's GPUs (``devices``, default the first ``gpus``) hold at most
    ``GPU_BUSY_MIB`` each (or nothing can tell); else, after ``wait_s``, why not (a leftover
    process would turn every later trial into a false OOM)."""
    devices = tuple(range(gpus)) if devices is None else tuple(devices)
    deadline = time.monotonic() + wait_s
    while True:
        used = probe()
        if used is None:
            return None
        busy = {i: used[i] for i in devices if i < len(used) and used[i] > GPU_BUSY_MIB}
        if not busy:
            return None
        if time.monotonic() >= deadline:
            return (
                f"GPU memory held by another process before the trial: "
                f"{', '.join(f'GPU {i}: {u:.0f} MiB' for i, u in busy.items())} "
                f"(limit {GPU_BUSY_MIB} MiB); free the GPUs and rerun"
            )
        time.sleep(5)


def trial_command(flags: list[str], *, gpus: int, report: str, capped: bool = False) -> list[str]:
    """The torchrun command line of one trial (its step report, memory phases included,
    written to ``report``);
    ``capped``: through ``benchmarks.capped_pretrain`` (the allocator cap from the env)."""
    module = CAPPED_MODULE if capped else "relaymoe.megatron.pretrain"
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(gpus),
        "-m", module, *flags,
        "--relaymoe-report", report, MEMORY_PHASES_FLAG,
    ]  # fmt: skip


def visible_devices(devices, environ) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``devices`` (indices among the GPUs this process sees: the
    parent's own ``CUDA_VISIBLE_DEVICES`` maps them)."""
    parent = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if parent:
        if max(devices) >= len(parent):
            raise ValueError(
                f"devices {list(devices)} but only {len(parent)} visible "
                f"(CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}); use fewer lanes"
            )
        return ",".join(parent[i].strip() for i in devices)
    return ",".join(str(i) for i in devices)


def launch(
    flags: list[str],
    *,
    gpus: int,
    timeout_s: float,
    workdir: Path,
    alloc_conf: str = ALLOC_CONF,
    cap_bytes: int | None = None,
    devices=None,
    cancel=None,
) -> dict:
    """One ``torchrun -m relaymoe.megatron.pretrain FLAGS`` job, output to ``workdir/log.txt``.

    Like ``benchmarks.e2e.run_pretrain`` (own process group, stopped on timeout), plus:
    the whole log is kept (an OOM on either rank is found wherever it is), ``ROOT`` is on
    ``PYTHONPATH`` (the ``--spec`` module lives in ``benchmarks/``), and every process the job
    started is killed by pid afterwards. ``alloc_conf`` is the job's
    ``PYTORCH_CUDA_ALLOC_CONF`` ("" for the allocator's default); ``cap_bytes`` caps each rank's
    allocator (``benchmarks.capped_pretrain``); ``devices``: the GPUs it runs on (indices among
    those this process sees; ``CUDA_VISIBLE_DEVICES``); ``cancel``: an event that stops the job
    (then ``KeyboardInterrupt``).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "steps.jsonl"
    report.unlink(missing_ok=True)
    log_path = workdir / "log.txt"
    cmd = trial_command(flags, gpus=gpus, report=str(report), capped=cap_bytes is not None)
    path = os.environ.get("PYTHONPATH")
    env = dict(
        os.environ,
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        OMP_NUM_THREADS="4",
        PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""),
    )
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if cap_bytes is not None:
        env["RELAYMOE_MEMORY_CAP_BYTES"] = str(cap_bytes)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(devices, os.environ)
    command = " ".join(shlex.quote(c) for c in cmd)
    envs = " ".join(
        f"{k}={shlex.quote(env[k])}"
        for k in ("PYTORCH_CUDA_ALLOC_CONF", "RELAYMOE_MEMORY_CAP_BYTES", "CUDA_VISIBLE_DEVICES")
        if k in env and (k != "CUDA_VISIBLE_DEVICES" or devices is not None)
    )
    command = f"{envs} {command}" if envs else command
    (workdir / "command.sh").write_text(command + "\n")
    t0 = time.perf_counter()
    timed_out = False
    seen: dict[int, int] = {}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
            start_new_session=True,
        )  # fmt: skip
        try:
            while True:
                seen.update(descendants(proc.pid))
                left = timeout_s - (time.perf_counter() - t0)
                if cancel is not None and cancel.is_set():
                    raise KeyboardInterrupt(f"trial in {workdir} cancelled")
                if left <= 0:
                    timed_out = True
                    stop_group(proc)  # torchrun's group; its workers are in their own sessions
                    break
                try:
                    proc.wait(timeout=min(1.0, left))
                    break
                except subprocess.TimeoutExpired:
                    pass
        except BaseException:  # e.g. Ctrl-C: do not leave workers on the GPUs
            stop_group(proc)
            kill_leftovers(seen)
            raise
    wall = time.perf_counter() - t0
    killed = kill_leftovers(seen)
    text = log_path.read_text(errors="replace")
    if killed:
        text += f"\n[max_seq] killed leftover processes {killed} after the job\n"
    steps = []
    if report.exists():
        steps = [json.loads(x) for x in report.read_text().splitlines() if x.strip()]
    return {
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "wall_s": wall,
        "steps": steps,
        "log": text,
        "command": command,
        "log_dir": str(workdir),
    }


# -- the search --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchResult:
    max_seq: int  # largest sequence that trained (0: none did)
    first_oom_seq: int | None  # smallest that ran out of memory
    upper_seq: int | None  # smallest failed trial (OOM or timeout)
    upper_reason: str | None
    bracket_open: bool  # max_seq is only a lower bound
    stop_reason: str  # converged | none_fits | timeout_bound | budget | error | limit
    trials: tuple[Trial, ...]
    error: str | None = None


def search_max_seq(
    run_trial: Callable[[int, float], Trial],
    *,
    start: int,
    max_trial_s: float,
    estimate_s: Callable[[int], float],
    step: int = SEQ_STEP,
    limit: int = SEQ_LIMIT,
    budget_s: float | None = None,
    growth: float = GROWTH0,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
    min_trial_s: float = MIN_TRIAL_S,
) -> SearchResult:
    """Longest multiple of ``step`` (at most ``limit``) for which ``run_trial(seq, timeout_s)``
    is ok, assuming that fitting is monotone in ``seq``.

    Tries ``start`` (rounded down to ``step``) first; grows after a success by ``growth`` of
    the largest success, shrinks after a failure by ``1 + growth`` of the smallest failure, the
    fraction doubling at every move, until a success and a failure bracket the answer; then
    bisects to one ``step``. A timeout bounds the search from above like an OOM but leaves the
    bracket open; ``budget`` and ``error`` stop it. A trial starts only with
    ``max(estimate_s(seq), min_trial_s)`` of ``budget_s`` left; its timeout is ``max_trial_s``
    or the budget left, whichever is smaller (cut by the budget, it is a ``budget`` trial).
    """
    if step < 1 or limit < step:
        raise ValueError(f"step={step}, limit={limit}: need 1 <= step <= limit")
    kmax = limit // step
    k = min(max(start // step, 1), kmax)
    lo, hi, hi_reason = 0, None, None  # lo: largest ok (0: none yet); hi: smallest failure
    g = growth
    trials: list[Trial] = []
    t0 = clock()
    stop, error = None, None
    while stop is None:
        seq = k * step
        est = estimate_s(seq)
        left = None if budget_s is None else budget_s - (clock() - t0)
        if left is not None and left < max(est, min_trial_s):
            log(f"  seq {seq}: not started, estimated {est:.0f} s with {max(left, 0):.0f} s "
                "of the budget left")  # fmt: skip
            stop = "budget"
            break
        timeout = max_trial_s if left is None else min(max_trial_s, left)
        warn = " (above --max-trial-s: it will likely time out)" if est > max_trial_s else ""
        log(f"  seq {seq}: starting, estimated {est:.0f} s, timeout {timeout:.0f} s{warn}")
        t = dataclasses.replace(run_trial(seq, timeout), est_s=est, timeout_s=timeout)
        if t.reason == "timeout" and timeout < max_trial_s:
            t = dataclasses.replace(t, reason="budget", detail=t.detail + " (cut by --budget-s)")
        trials.append(t)
        log("  " + trial_line(t))
        if t.reason == "error":
            stop, error = "error", t.detail
        elif t.reason == "budget":
            stop = "budget"
        elif t.ok:
            lo = k
        else:  # oom or timeout
            hi, hi_reason = k, t.reason
        if stop is not None:
            break
        if hi is None:  # only successes so far: grow
            if lo >= kmax:
                stop = "limit"
                break
            k = min(kmax, max(lo + 1, math.ceil(lo * (1 + g))))
            g *= 2
        elif lo == 0:  # only failures so far: shrink
            if hi == 1:
                stop = "none_fits" if hi_reason == "oom" else "timeout_bound"
                break
            k = max(1, min(hi - 1, math.floor(hi / (1 + g))))
            g *= 2
        elif hi - lo <= 1:
            stop = "converged" if hi_reason == "oom" else "timeout_bound"
        else:
            k = (lo + hi) // 2
    ooms = [t.seq for t in trials if t.reason == "oom"]
    return SearchResult(
        max_seq=lo * step,
        first_oom_seq=min(ooms) if ooms else None,
        upper_seq=None if hi is None else hi * step,
        upper_reason=hi_reason,
        bracket_open=stop not in ("converged", "none_fits"),
        stop_reason=stop,
        trials=tuple(trials),
        error=error,
    )


def trial_line(t: Trial) -> str:
    """One printed line per trial: outcome, wall time, peak memory, and why it failed."""
    mem = []
    if t.peak_MiB is not None:
        mem.append(f"peak {t.peak_MiB:.0f} MiB")
    if t.megatron_max_allocated_MB is not None:
        mem.append(
            f"Megatron max allocated {t.megatron_max_allocated_MB:.0f} MB, max reserved "
            f"{t.megatron_max_reserved_MB:.0f} MB"
        )
    if t.oom_allocated_MiB is not None:
        mem.append(f"{t.oom_allocated_MiB:.0f} MiB allocated at the OOM")
    if t.oom_request_MiB is not None:
        mem.append(f"asked {t.oom_request_MiB:.0f} MiB more")
    head = f"seq {t.seq}: {t.reason.upper()} after {t.wall_s:.0f} s"
    head += f" ({'; '.join(mem)})" if mem else ""
    if t.ok:
        return head
    detail = t.detail if t.reason != "error" else t.detail.split("\n", 1)[0]
    where = f" [log: {t.log_dir}/log.txt]" if t.log_dir else ""
    return f"{head}: {detail}{where}"


# -- rows and the command line -----------------------------------------------------------------


def device_facts(gpus: int) -> dict:
    """GPU names and (free, total) memory from ``torch.cuda.mem_get_info`` in a subprocess, so
    that this process never holds a CUDA context on a GPU that the trials need."""
    code = (
        "import json, torch\n"
        "n = torch.cuda.device_count()\n"
        "print(json.dumps({'count': n, 'devices': [dict(name=torch.cuda.get_device_name(i), "
        f"mem=torch.cuda.mem_get_info(i)) for i in range(min(n, {gpus}))]}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"querying the GPUs failed:\n{out.stderr[-2000:]}")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    devs = facts["devices"]
    if devs:
        facts["gpu"] = devs[0]["name"]
        facts["free_bytes"] = min(d["mem"][0] for d in devs)
        facts["total_bytes"] = min(d["mem"][1] for d in devs)
    return facts


def job_row(
    job: Job,
    res: SearchResult,
    *,
    a,
    pred: Prediction,
    facts: dict,
    cap_bytes: int | None,
    wall_s: float,
    budget_s: float | None,
    anchor: dict,
    lane: tuple[int, ...] = (0,),
) -> dict:
    """The row of ``job``: its search, the planner beside it, and ``anchor`` (``anchor_seq``,
    ``trial`` (the timed trial at that length, or None) and ``note``)."""
    p = PROVIDERS[job.provider]
    gpus = a.gpus
    predicted = pred.max_seq.get(job)
    at_max = next((t for t in res.trials if t.ok and t.seq == res.max_seq), None)
    shown = at_max or (res.trials[0] if res.trials else None)
    flags = []
    if shown is not None:
        flags = trial_flags(a.config, job.provider, shown.seq, gpus=gpus, steps=a.steps,
                            seed=a.seed, policy=job.policy, gpu_bytes=pred.gpu_bytes)  # fmt: skip
    planned = None
    if res.max_seq:
        planned = planner_breakdown(a.config, gpus, job, res.max_seq, pred.usable_bytes)
    measured = at_max.memory if at_max else None
    own_tps = at_max.tokens_per_s if at_max else None
    at_anchor = anchor.get("trial")
    if job.anchor == job:
        tps_anchor = own_tps
    else:
        tps_anchor = at_anchor.tokens_per_s if at_anchor is not None and at_anchor.ok else None
    return {
        "bench": "max_seq",
        "provider": job.provider,
        "recompute_policy": job.policy,
        "flags": flags,
        "transformer_impl": TE_IMPL if uses_te(p.transformer_impl) else "local",
        "ce_fusion": p.ce_fusion,
        "shape": f"{a.config}_ep{gpus}",
        "config": a.config,
        "ep": gpus,
        "gpus": gpus,
        "dispatcher": p.dispatcher,
        "fused_loss": p.fused_loss,
        "ring_mode": "auto" if p.dispatcher == "ring" else None,
        "micro_batch_size": 1,
        "recompute": " ".join(shown.recompute) if shown is not None else None,
        "steps_per_trial": a.steps,
        "seq_step": SEQ_STEP,
        "attention": "transformer_engine" if uses_te(p.transformer_impl) else "sdpa_flash",
        "normalization_impl": normalization_impl(job.provider),
        "alloc_conf": a.alloc_conf or None,
        "memory_cap_gpu": a.memory_cap,
        "memory_cap_bytes": cap_bytes,
        "max_seq": res.max_seq,
        "first_oom_seq": res.first_oom_seq,
        "upper_seq": res.upper_seq,
        "upper_reason": res.upper_reason,
        "bracket_open": res.bracket_open,
        "stop_reason": res.stop_reason,
        "error": res.error,
        "n_trials": len(res.trials),
        "trials": [t.to_dict() for t in res.trials],
        "peak_MiB_at_max_seq": at_max.peak_MiB if at_max else None,
        "tokens_per_s_at_max_seq": own_tps,
        "anchor": job.anchor.provider,
        "anchor_max_seq": anchor.get("seq"),
        "tokens_per_s_at_anchor_seq": tps_anchor,
        "anchor_seq_trial": at_anchor.to_dict() if at_anchor is not None else None,
        "anchor_seq_note": anchor.get("note"),
        "measured_breakdown": measured,
        "binding_term": measured.get("binding_term") if measured else None,
        "planner_breakdown_at_max_seq": planned,
        "planner_binding_term": planned["binding_term"] if planned else None,
        "predicted_max_seq": predicted,
        "predicted_over_measured": (predicted / res.max_seq) if predicted and res.max_seq else None,
        "planner_peak_at_max_seq_MiB": planned["total"] / 2**20 if planned else None,
        "planner_breakdown_at_predicted": pred.breakdown.get(job),
        "planner_gpu_bytes": pred.gpu_bytes,
        "planner_usable_bytes": pred.usable_bytes,
        "gpu_total_bytes": facts.get("total_bytes"),
        "gpu_free_bytes": facts.get("free_bytes"),
        "lane": list(lane),
        "wall_s": wall_s,
        "budget_s": budget_s,
        "max_trial_s": a.max_trial_s,
    }


def first_trial(predicted: int | None, fallback: int, step: int = SEQ_STEP) -> int:
    """The planner's prediction rounded down to ``step`` (``fallback`` without one)."""
    seq = predicted if predicted else fallback
    return max(step, seq // step * step)


def ladder(start: int, step: int, n: int = 3, growth: float = GROWTH0) -> tuple[list, list]:
    """The first ``n`` sequences the search tries above (all ok) and below (all failing)."""
    up, down = [], []
    k, g = start // step, growth
    for _ in range(n):
        k = max(k + 1, math.ceil(k * (1 + g)))
        up.append(k * step)
        g *= 2
    k, g = start // step, growth
    for _ in range(n):
        if k <= 1:
            break
        k = max(1, min(k - 1, math.floor(k / (1 + g))))
        down.append(k * step)
        g *= 2
    return up, down


def print_plan(jobs, pred: Prediction, a, gpus: int) -> None:
    print(
        f"planner: GPU {pred.gpu_bytes / 1e9:.1f} GB -> usable {pred.usable_bytes / 2**30:.1f} "
        f"GiB per GPU; config {a.config}, EP={gpus}, micro-batch 1, policies {a.policies}"
    )
    for job in jobs:
        p = PROVIDERS[job.provider]
        predicted = pred.max_seq.get(job)
        tm = TimeModel(planner_config(a.config, gpus, job.provider), steps=a.steps,
                       policy=job.policy)  # fmt: skip
        start = first_trial(a.start_seq or predicted, 32768)
        up, down = ladder(start, SEQ_STEP, growth=a.growth)
        fmt = ", ".join
        at = pred.breakdown.get(job) or {}
        layers = "TransformerEngine" if uses_te(p.transformer_impl) else "local layers + SDPA"
        print(f"== {job.name}: planner predicts {predicted if predicted is not None else '-'} "
              f"({p.variant}, {layers}; binds: {at.get('binding_term') or '-'})")  # fmt: skip
        print(f"   first trial {start} (est {tm.trial_s(start):.0f} s); if it trains: "
              f"{fmt(f'{s} ({tm.trial_s(s):.0f} s)' for s in up)}, ...; if not: "
              f"{fmt(f'{s} ({tm.trial_s(s):.0f} s)' for s in down)}, ...; then bisection to "
              f"{SEQ_STEP}")  # fmt: skip
        flags = trial_flags(a.config, job.provider, start, gpus=gpus, steps=a.steps,
                            seed=a.seed, policy=job.policy, gpu_bytes=pred.gpu_bytes,
                            check_te=False)  # fmt: skip
        cmd = trial_command(
            flags, gpus=gpus, report="<trial>/steps.jsonl", capped=bool(a.memory_cap)
        )
        print("   " + shlex.join(cmd))


def trial_markers(provider: str, capped: bool) -> tuple[str, ...]:
    """What a trial's log must say for its numbers to count: the SDPA attention's marker (no
    TE) and the allocator cap's (``--memory-cap``)."""
    marker = () if uses_te(PROVIDERS[provider].transformer_impl) else (SDPA_MARKER,)
    if capped:
        from benchmarks.capped_pretrain import MARKER as CAP_MARKER

        marker += (CAP_MARKER,)
    return marker


def anchor_seq_from_rows(path: str | None, job: Job, a) -> int | None:
    """The anchor's longest sequence for ``job`` from an earlier run's rows (``--anchor-rows``):
    the last row of the anchor under the same policy, config, GPUs and cap; None without."""
    if not path or not Path(path).is_file():
        return None
    found = None
    for line in Path(path).read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        same = (r.get("bench"), r.get("provider"), r.get("recompute_policy"), r.get("config"),
                r.get("gpus"), r.get("memory_cap_gpu"))  # fmt: skip
        if same == ("max_seq", job.anchor.provider, job.policy, a.config, a.gpus, a.memory_cap):
            found = r.get("max_seq")
    return found


class Campaign:
    """The jobs of one invocation on its lanes: each job's search, then its timed trial at the
    anchor's longest sequence once both searches are done, then its row."""

    def __init__(self, a, jobs, pred, facts, cap_bytes, lanes, workdir, writer):
        self.a, self.jobs, self.pred, self.facts = a, list(jobs), pred, facts
        self.cap_bytes, self.lanes, self.workdir, self.writer = cap_bytes, lanes, workdir, writer
        self.queue = LaneQueue(lanes)
        self.lock = threading.Lock()
        self.results: dict = {}  # Job -> (SearchResult, TimeModel, wall_s, budget_s)
        self.waiting: set = set()  # searched jobs waiting for their anchor's search
        self.rows: list[dict] = []
        self.searches_left = len(self.jobs)
        self.t0 = time.monotonic()

    def log(self, job: Job, text: str) -> None:
        prefix = f"[{job.name}] " if len(self.lanes) > 1 else ""
        print(prefix + text, flush=True)

    def left_s(self) -> float | None:
        if self.a.budget_s is None:
            return None
        return self.a.budget_s - (time.monotonic() - self.t0)

    def search_budget(self) -> float | None:
        """This search's share: the time left x lanes / searches left, at most
        ``--search-budget-s``."""
        with self.lock:
            left, n = self.left_s(), self.searches_left
            self.searches_left -= 1
        share = None if left is None else left * len(self.lanes) / max(n, 1)
        cap = self.a.search_budget_s
        if cap is not None:
            share = cap if share is None else min(share, cap)
        return share

    def trial(self, job: Job, seq: int, timeout_s: float, lane, tm, folder: str) -> Trial:
        a = self.a
        if self.queue.cancel.is_set():
            return Trial(seq, "error", 0.0, detail="cancelled")
        busy = wait_gpus_free(a.gpus, devices=lane)
        if busy is not None:
            return Trial(seq, "error", 0.0, detail=busy)
        flags = trial_flags(a.config, job.provider, seq, gpus=a.gpus, steps=a.steps, seed=a.seed,
                            policy=job.policy, gpu_bytes=self.pred.gpu_bytes)  # fmt: skip
        r = launch(
            flags, gpus=a.gpus, timeout_s=timeout_s, workdir=self.workdir / job.folder / folder,
            alloc_conf=a.alloc_conf, cap_bytes=self.cap_bytes,
            devices=lane if len(self.lanes) > 1 else None, cancel=self.queue.cancel,
        )  # fmt: skip
        t = trial_from_log(
            seq, returncode=r["returncode"], timed_out=r["timed_out"], timeout_s=timeout_s,
            wall_s=r["wall_s"], steps=r["steps"], log=r["log"], expected_steps=a.steps,
            marker=trial_markers(job.provider, self.cap_bytes is not None), log_dir=r["log_dir"],
        )  # fmt: skip
        recompute = [f for g in flag_groups(flags) if g[0] in RECOMPUTE_FLAGS for f in g]
        t = dataclasses.replace(t, recompute=tuple(recompute))
        if t.ok and t.step_s:
            tm.calibrate(seq, t.step_s[-1], t.wall_s)
        if t.reason == "error":
            print(f"--- {job.name} seq {seq}: ERROR\ncommand: {r['command']}\n{t.detail}\n---",
                  file=sys.stderr, flush=True)  # fmt: skip
        return t

    def search(self, job: Job, lane) -> None:
        a = self.a
        share = self.search_budget()
        budget = "-" if share is None else f"{share:.0f} s"
        self.log(job, f"== {job.name}: search (budget {budget}, trial timeout "
                      f"{a.max_trial_s:.0f} s, lane {list(lane)}, logs under "
                      f"{self.workdir / job.folder})")  # fmt: skip
        tm = TimeModel(planner_config(a.config, a.gpus, job.provider), steps=a.steps,
                       policy=job.policy)  # fmt: skip
        t0 = time.monotonic()
        res = search_max_seq(
            lambda seq, timeout: self.trial(job, seq, timeout, lane, tm, f"s{seq}"),
            start=first_trial(a.start_seq or self.pred.max_seq.get(job), 32768),
            max_trial_s=a.max_trial_s, estimate_s=tm.trial_s, limit=a.limit_seq,
            budget_s=share, growth=a.growth, log=lambda text: self.log(job, text),
            min_trial_s=a.min_trial_s,
        )  # fmt: skip
        self.log(job, f"== {job.name}: max_seq {res.max_seq} ({res.stop_reason}"
                      f"{', a lower bound' if res.bracket_open else ''}), first OOM "
                      f"{res.first_oom_seq}, predicted {self.pred.max_seq.get(job)}")  # fmt: skip
        with self.lock:
            self.results[job] = (res, tm, time.monotonic() - t0, share)
            ready = self.ready_after(job)
        for j in ready:
            self.queue.put(lambda lane, j=j: self.time_at_anchor(j, lane))

    def ready_after(self, job: Job) -> list[Job]:
        """The searched jobs whose timed trial at the anchor's length can run now that
        ``job``'s search is done (called under the lock)."""
        anchor = job.anchor
        if anchor == job:
            ready = [job] + sorted((j for j in self.waiting if j.anchor == job),
                                   key=self.jobs.index)  # fmt: skip
            self.waiting -= set(ready)
            return ready
        if anchor in self.jobs and anchor not in self.results:
            self.waiting.add(job)
            return []
        return [job]

    def anchor_length(self, job: Job) -> int | None:
        if job.anchor in self.results:
            return self.results[job.anchor][0].max_seq
        return anchor_seq_from_rows(self.a.anchor_rows, job, self.a)

    def time_at_anchor(self, job: Job, lane) -> None:
        """The job's trial at the anchor's longest sequence (reused from its search where it
        has one at that length), then its row."""
        res, tm, wall, share = self.results[job]
        seq = self.anchor_length(job)
        trial, note = None, None
        if job.anchor == job:
            note = "the anchor itself"
        elif not seq:
            note = ("the anchor trained no sequence" if seq == 0 else
                    "the anchor was not run (add it, or pass --anchor-rows)")  # fmt: skip
        elif res.stop_reason == "error":
            note = "not run: the search stopped on an error"
        elif res.first_oom_seq is not None and res.first_oom_seq <= seq:
            note = f"out of memory at {res.first_oom_seq} <= the anchor's {seq}"
        else:
            trial = next((t for t in res.trials if t.ok and t.seq == seq), None)
            note = "a trial of the search at that length" if trial else None
        if job.anchor != job and seq and trial is None and note is None:
            est, left = tm.trial_s(seq), self.left_s()
            if left is not None and left < max(est, self.a.min_trial_s):
                note = f"not run: estimated {est:.0f} s with {max(left, 0):.0f} s left"
            else:
                timeout = self.a.max_trial_s if left is None else min(self.a.max_trial_s, left)
                self.log(job, f"  at the anchor's {seq}: starting, estimated {est:.0f} s")
                trial = dataclasses.replace(
                    self.trial(job, seq, timeout, lane, tm, f"anchor_s{seq}"), est_s=est,
                    timeout_s=timeout,
                )  # fmt: skip
                self.log(job, "  at the anchor's length: " + trial_line(trial))
                note = "a second, timed trial"
        row = job_row(
            job, res, a=self.a, pred=self.pred, facts=self.facts, cap_bytes=self.cap_bytes,
            wall_s=wall, budget_s=share, anchor={"seq": seq, "trial": trial, "note": note},
            lane=lane,
        )  # fmt: skip
        with self.lock:
            self.rows.append(self.writer.write(row))

    def run(self) -> list[dict]:
        for job in self.jobs:
            self.queue.put(lambda lane, job=job: self.search(job, lane))
        self.queue.run()
        return self.rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS),
                   help=f"comma-separated, in order; known: {', '.join(PROVIDERS)}")  # fmt: skip
    p.add_argument("--policies", default="full",
                   help=f"recompute policies, comma-separated; known: "
                        f"{', '.join(POLICIES)}")  # fmt: skip
    p.add_argument("--gpus", type=int, default=2, help="GPUs per trial = EP = data-parallel size")
    p.add_argument("--lanes", default="1",
                   help="jobs at once, each on its own --gpus GPUs ('all': every GPU)")  # fmt: skip
    p.add_argument("--steps", type=int, default=STEPS, help="training steps per trial")
    p.add_argument("--budget-s", type=float, default=None, help="wall-time bound of everything")
    p.add_argument("--search-budget-s", type=float, default=None,
                   help="at most this for one job's search (the rest is left for the others "
                        "and the timed trials at the anchors' lengths)")  # fmt: skip
    p.add_argument("--max-trial-s", type=float, default=1200.0, help="timeout of one trial")
    p.add_argument("--min-trial-s", type=float, default=MIN_TRIAL_S,
                   help="no trial starts with less budget left (default "
                        f"{MIN_TRIAL_S:.0f})")  # fmt: skip
    p.add_argument("--start-seq", type=int, default=None,
                   help="first trial (default: the planner's prediction, 32768 without one); "
                        "to resume a search next to trials already made")  # fmt: skip
    p.add_argument("--limit-seq", type=int, default=SEQ_LIMIT, help="never try above this")
    p.add_argument("--gpu-bytes", default=None,
                   help="GPU memory for the planner (bytes, 141GB, a preset); default: the "
                        f"GPUs' total from torch.cuda.mem_get_info ({DEFAULT_GPU} in --dry-run "
                        "without GPUs)")  # fmt: skip
    p.add_argument("--alloc-conf", default=ALLOC_CONF,
                   help=f"the trials' PYTORCH_CUDA_ALLOC_CONF (default {ALLOC_CONF}; '' for "
                        "the allocator's default)")  # fmt: skip
    p.add_argument("--memory-cap", default=None, metavar="GPU",
                   help="emulate a smaller GPU (a planner preset such as h100-80gb, or bytes): "
                        "each trial's allocator is capped at the planner's usable bytes of that "
                        "GPU, and the planner plans for it")  # fmt: skip
    p.add_argument("--growth", type=float, default=GROWTH0,
                   help=f"first bracket move as a fraction of the sequence (default {GROWTH0});"
                        " smaller where the planner is trusted to a few percent")  # fmt: skip
    p.add_argument("--anchor-rows", default=None,
                   help="rows of an earlier run holding the anchors' longest sequences, for "
                        "providers whose anchor is not run here")  # fmt: skip
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workdir", default=None, help="trial folders and logs (default: a temp dir)")
    p.add_argument("--dry-run", action="store_true", help="print predictions and the trial plan")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "max_seq.jsonl"))
    return p, p.parse_args(argv)


def checked_args(p, a):
    """(providers, policies, gpu_bytes or None) of parsed arguments ``a``, or ``p.error``."""
    providers = [s.strip() for s in a.providers.split(",") if s.strip()]
    unknown = [n for n in providers if n not in PROVIDERS]
    if unknown or not providers:
        p.error(f"unknown provider(s) {unknown or providers}; known: {', '.join(PROVIDERS)}")
    policies = [s.strip() for s in a.policies.split(",") if s.strip()]
    if not policies or set(policies) - set(POLICIES):
        p.error(f"--policies {a.policies!r}; known: {', '.join(POLICIES)}")
    if a.steps < 2:
        p.error(f"--steps {a.steps}: at least 2 (the issue's criterion is two training steps)")
    if a.limit_seq < SEQ_STEP:
        p.error(f"--limit-seq {a.limit_seq} is below the search step {SEQ_STEP}")
    if not 0 < a.growth <= 1:
        p.error(f"--growth {a.growth}: a fraction in (0, 1]")
    if a.memory_cap and a.gpu_bytes:
        p.error("--memory-cap names the GPU the planner plans for; drop --gpu-bytes")
    if a.lanes != "all" and not (a.lanes.isdigit() and int(a.lanes) >= 1):
        p.error(f"--lanes {a.lanes!r}: a count of at least 1, or 'all'")
    from relaymoe.planner.plan import parse_gpu

    try:
        gpu_bytes = parse_gpu(a.gpu_bytes or a.memory_cap) if a.gpu_bytes or a.memory_cap else None
        for name in providers:  # bad flags now (TE providers: checked when they run)
            trial_flags(a.config, name, SEQ_STEP, gpus=a.gpus, steps=a.steps,
                        gpu_bytes=gpu_bytes or parse_gpu(DEFAULT_GPU), check_te=False)  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    return providers, policies, gpu_bytes


def main(argv: list[str] | None = None) -> int:
    p, a = parse_args(argv)
    providers, policies, gpu_bytes = checked_args(p, a)
    from relaymoe.planner.plan import parse_gpu, usable_bytes

    gpus, jobs = a.gpus, jobs_of(providers, policies)
    cap_bytes = usable_bytes(gpu_bytes) if a.memory_cap else None
    if a.dry_run:
        pred = predict(a.config, gpus, gpu_bytes or parse_gpu(DEFAULT_GPU), jobs)
        print_plan(jobs, pred, a, gpus)
        return 0
    facts = device_facts(1 << 10 if a.lanes == "all" else int(a.lanes) * gpus)
    n_lanes = facts["count"] // gpus if a.lanes == "all" else int(a.lanes)
    if n_lanes < 1 or facts["count"] < n_lanes * gpus:
        print(f"max_seq: needs {max(n_lanes, 1) * gpus} CUDA GPUs ({n_lanes} lanes of {gpus}), "
              f"found {facts['count']}; nothing measured")  # fmt: skip
        return 3
    missing_te = [n for n in providers if PROVIDERS[n].transformer_impl == TE_IMPL]
    if missing_te and not have_te():
        print(f"max_seq: {missing_te} run TransformerEngine, which does not import here; "
              "nothing measured")  # fmt: skip
        return 2
    if cap_bytes is not None and cap_bytes > facts["total_bytes"]:
        print(f"max_seq: --memory-cap {a.memory_cap} ({cap_bytes} usable bytes) exceeds this "
              f"GPU's {facts['total_bytes']} bytes; nothing measured")  # fmt: skip
        return 2
    if facts["free_bytes"] < 0.9 * facts["total_bytes"]:
        free, total = facts["free_bytes"] / 2**30, facts["total_bytes"] / 2**30
        print(f"max_seq: warning: only {free:.1f} of {total:.1f} GiB free on a GPU: another "
              "process uses it, and the trials will fit less than the planner assumes")  # fmt: skip
    pred = predict(a.config, gpus, gpu_bytes or facts["total_bytes"], jobs)
    print_plan(jobs, pred, a, gpus)
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="relaymoe_max_seq_"))
    writer = JsonlWriter(a.out, env=environment(facts["gpu"]))
    if cap_bytes is not None:
        print(f"trials capped at {cap_bytes} bytes per GPU (the planner's usable bytes of "
              f"{a.memory_cap})", flush=True)  # fmt: skip
    print(f"PYTORCH_CUDA_ALLOC_CONF={a.alloc_conf or '(default)'}; {n_lanes} lane(s) of "
          f"{gpus} GPU(s)", flush=True)  # fmt: skip
    t_all = time.monotonic()
    campaign = Campaign(a, jobs, pred, facts, cap_bytes, lane_devices(n_lanes, gpus), workdir,
                        writer)  # fmt: skip
    rows = campaign.run()
    print_summary(rows)
    print(f"rows appended to {a.out}; {time.monotonic() - t_all:.0f} s in all; logs in {workdir}")
    return 0 if all(r["stop_reason"] != "error" for r in rows) else 1


def counterpart(provider: str) -> str | None:
    """The alltoall provider with the same loss and layers as a ring provider (None for
    alltoall providers): the comparison that isolates the dispatcher."""
    p = PROVIDERS[provider]
    if p.dispatcher != "ring":
        return None
    return next((q.name for q in PROVIDERS.values() if q.dispatcher == "alltoall"
                 and q.fused_loss == p.fused_loss
                 and q.transformer_impl == p.transformer_impl), None)  # fmt: skip


def print_summary(rows: list[dict]) -> None:
    from benchmarks.common import print_table

    rows = sorted(rows, key=lambda r: (POLICIES.index(r["recompute_policy"]),
                                       list(PROVIDERS).index(r["provider"])))  # fmt: skip
    print_table(
        rows,
        ["provider", "recompute_policy", "predicted_max_seq", "max_seq", "first_oom_seq",
         "bracket_open", "stop_reason", "n_trials", "peak_MiB_at_max_seq",
         "planner_peak_at_max_seq_MiB", "binding_term", "planner_binding_term",
         "tokens_per_s_at_max_seq", "tokens_per_s_at_anchor_seq", "wall_s"],
    )  # fmt: skip
    by = {(r["provider"], r["recompute_policy"]): r for r in rows}
    for r in rows:
        pol = r["recompute_policy"]
        for other, why in ((r["anchor"], "anchor"), (counterpart(r["provider"]), "same loss")):
            base = by.get((other, pol))
            if base is None or base is r or not base["max_seq"] or not r["max_seq"]:
                continue
            line = (f"{r['provider']} ({pol}): {r['max_seq'] / base['max_seq']:.2f}x "
                    f"{other}'s longest sequence ({why})")  # fmt: skip
            tps, tps0 = r.get("tokens_per_s_at_anchor_seq"), base.get("tokens_per_s_at_anchor_seq")
            if why == "anchor" and tps and tps0:
                line += f"; {tps / tps0:.2f}x its tokens/s at the anchor's longest sequence"
            print(line)


__all__ = [
    "PROVIDERS",
    "Campaign",
    "Job",
    "SearchResult",
    "TimeModel",
    "Trial",
    "classify",
    "main",
    "search_max_seq",
    "trial_flags",
]

if __name__ == "__main__":
    sys.exit(main())
