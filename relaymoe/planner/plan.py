"""``plan(cfg, gpu_bytes) -> Plan``: routing mode, memory breakdown, recompute plan and capacity
limits (largest sequence / micro-batch) for the ring and the alltoall dispatcher, each with
Megatron's loss and with relaymoe's fused loss (``VARIANTS``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from relaymoe.config import Config, config_from_dict, recompute_args, to_megatron_args
from relaymoe.options import MODES, RING_MODES, KernelOptions
from relaymoe.planner import memory as mm
from relaymoe.planner import mode as pm
from relaymoe.planner import policies as pol
from relaymoe.planner.recompute import (
    RecomputePlan,
    binding_term,
    plan_recompute,
    worst_stage_peak,
)

GiB = 2**30
MiB = 2**20
# Each preset is the device's total memory as the driver reports it (``nvidia-smi``'s "Total",
# in MiB), the same figure a ``--gpu`` byte count stands for; ``usable_bytes`` takes the CUDA
# context and the other reserves off it.
GPU_TOTAL_MIB = {
    "h100-80gb": 81_559,  # H100 SXM5 80GB HBM3, nvidia-smi
    # the paper's MareNostrum 5 H100 (64 GB HBM2e): no driver figure at hand, so 64 GiB scaled
    # by the 80GB H100's reported share of its 80 GiB of HBM (81,559 / 81,920)
    "h100-64gb": 65_247,
    "h200-141gb": 143_771,  # H200 SXM 141GB, nvidia-smi on the machines of our results
    "a100-80gb": 81_920,  # A100 SXM4 80GB, nvidia-smi
    "a100-40gb": 40_960,  # A100 SXM4 40GB, nvidia-smi
}
GPUS = {name: mib * MiB for name, mib in GPU_TOTAL_MIB.items()}
DEFAULT_GPU = "h100-80gb"
# What a training process cannot allocate out of the driver's total: the driver's own
# reservation (nvidia-smi's total less torch.cuda.mem_get_info's) plus a fresh process's CUDA
# context (its free memory below that total): 615 + 527 MiB measured on an H200 (CUDA 13.0).
CUDA_CONTEXT_BYTES = 1_142 * MiB
RESERVE_FIXED = 2 * GiB  # NCCL buffers, cuBLAS workspaces
RESERVE_FRACTION = 0.03  # allocator fragmentation
SEQ_LIMIT = 1 << 22
MBS_LIMIT = 4096
# What the plan compares: variant -> (dispatcher, fused loss). The plain names keep Megatron's
# output layer + vocab-parallel cross-entropy whatever the config says, so that each column
# shows what one switch buys; the config picks the variant its flags are for (``Plan.chosen``).
VARIANTS = {
    "alltoall": ("alltoall", False),
    "ring": ("ring", False),
    "alltoall_fused_loss": ("alltoall", True),
    "ring_fused_loss": ("ring", True),
}


def parse_gpu(spec: str | int) -> int:
    """A preset name (``h100-80gb``...) or a byte count (``85899345920``, ``80GiB``, ``64GB``):
    the device's total memory as the driver reports it (``GPU_TOTAL_MIB``)."""
    if isinstance(spec, int):
        b = spec
    else:
        s = str(spec).strip().lower()
        if s in GPUS:
            return GPUS[s]
        units = {"gib": GiB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "": 1}
        for u in sorted(units, key=len, reverse=True):
            if s.endswith(u) and s[: len(s) - len(u)].replace(".", "", 1).isdigit():
                b = int(float(s[: len(s) - len(u)]) * units[u])
                break
        else:
            raise ValueError(
                f"--gpu {spec!r}: not a preset ({', '.join(GPUS)}) nor a byte count "
                "(e.g. 85899345920, 80GiB)"
            )
    if b < min_gpu_bytes():
        raise ValueError(
            f"--gpu {spec!r} is {b / GiB:.2f} GiB, which leaves nothing usable after the CUDA "
            f"context and the reserves (planner.usable_bytes); give the GPU's total memory as "
            f"nvidia-smi reports it, more than {min_gpu_bytes() / GiB:.2f} GiB (e.g. 80GiB, or "
            f"a preset: {', '.join(GPUS)})"
        )
    return b


def usable_bytes(gpu_bytes: int) -> int:
    """The bytes a plan may fill on a GPU whose driver reports ``gpu_bytes`` in total: less the
    CUDA context (``CUDA_CONTEXT_BYTES``), then the fragmentation share and the fixed reserve.
    Raises ``ValueError`` when that leaves nothing (a GPU below :func:`min_gpu_bytes`)."""
    usable = int((gpu_bytes - CUDA_CONTEXT_BYTES) * (1 - RESERVE_FRACTION) - RESERVE_FIXED)
    if usable <= 0:
        raise ValueError(
            f"a GPU of {gpu_bytes / GiB:.2f} GiB leaves nothing usable after the CUDA context "
            f"({CUDA_CONTEXT_BYTES / GiB:.2f} GiB), {RESERVE_FRACTION:.0%} for fragmentation "
            f"and {RESERVE_FIXED / GiB:.0f} GiB for NCCL and cuBLAS; give the GPU's total memory "
            f"as nvidia-smi reports it (more than {min_gpu_bytes() / GiB:.2f} GiB)"
        )
    return usable


def min_gpu_bytes() -> int:
    """The smallest GPU total that leaves any usable bytes (``usable_bytes`` > 0)."""
    return math.ceil(RESERVE_FIXED / (1 - RESERVE_FRACTION)) + CUDA_CONTEXT_BYTES + 1


@dataclass(frozen=True)
class Plan:
    config_name: str
    world_size: int
    gpu_bytes: int
    usable_bytes: int
    dispatcher: str  # the config's dispatcher (ring unless the config says otherwise)
    fused_loss: bool  # the config's relaymoe.fused_loss
    routing_mode: str  # relaymoe mode the runtime runs: expert | token | alltoall
    transport: str  # the ring transport assumed: local | nccl | copy_engine
    per_hop_bytes: dict  # ring modes: {"expert": {...}, "token": {...}}
    step_model: dict  # per mode: link bytes per layer step and modelled seconds (relaymoe.cost)
    moe_peak_bytes: dict  # {"alltoall", "ring", "ring_expert", "ring_token", "ring_alltoall"}
    # per variant (``VARIANTS``):
    peak_bytes: dict  # under its recompute plan (None: does not fit)
    peak_full_recompute_bytes: dict
    breakdown: dict  # term -> bytes (worst stage, under its plan)
    recompute_plans: dict  # RecomputePlan.to_dict() or None
    max_seq_length: dict  # full recompute, this micro-batch
    max_micro_batch_size: dict  # full recompute, this sequence length
    max_seq_breakdown: dict  # {"seq", "stage", "terms"}: the worst stage at max_seq_length
    megatron_args: dict  # Megatron argument overrides (recompute_*) for ``chosen``
    megatron_flags: tuple[str, ...]  # the config's command line (``relaymoe flags``')
    notes: tuple[str, ...] = ()
    schedule: str = "flat"  # the ring's order (options.SCHEDULES) for the cluster shape
    gpus_per_node: int | None = None  # the cluster's (parallel.gpus_per_node; None: one node)
    hop_times: dict = field(default_factory=dict)  # per schedule: cost.ring_hop_times
    planned_recompute_flags: tuple[str, ...] = ()  # the planner's recompute for ``chosen``
    transformer_impl: str = mm.TE_IMPL  # what ``policies`` is predicted for
    # per variant and recompute policy (``policies.POLICIES``): max_seq, binding_term, terms
    policies: dict = field(default_factory=dict)
    # megatron-core's own memory flags (``policies.mcore_memory_flags``), the alternative
    # printed where the config's dispatcher is alltoall (empty for the ring)
    mcore_memory_flags: tuple[str, ...] = ()

    @property
    def chosen(self) -> str:
        """The variant the config runs (its dispatcher, with the fused loss if it sets it)."""
        return variant_name(self.dispatcher, self.fused_loss)

    @property
    def recompute_plan(self) -> dict | None:
        return self.recompute_plans.get(self.chosen)

    def summary(self) -> str:
        rp = self.recompute_plan or {}
        loss = ", fused loss" if self.fused_loss else ""
        return (
            f"{self.dispatcher} ({self.routing_mode} routing{loss}), peak "
            f"{_g(self.peak_bytes.get(self.chosen))} of {_g(self.usable_bytes)} GiB usable, "
            f"{len(rp.get('recomputed_layers', []))} layers recomputed, "
            f"{len(rp.get('kept_layers', []))} kept"
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["megatron_overrides"] = d.pop("megatron_args")
        d["megatron_args"] = list(self.megatron_flags)
        d.pop("megatron_flags")
        d["recompute_plan"] = self.recompute_plan
        d["chosen"] = self.chosen
        d["notes"] = list(self.notes)
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)


def _g(x) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def variant_name(dispatcher: str, fused_loss: bool) -> str:
    """``VARIANTS`` key: ``ring``, ``alltoall``, ``ring_fused_loss``, ``alltoall_fused_loss``."""
    return f"{dispatcher}_fused_loss" if fused_loss else dispatcher


def seq_quantum(cfg: Config) -> int:
    p = cfg.parallel
    q = (2 * p.cp if p.cp > 1 else 1) * (p.tp if p.sequence_parallel else 1)
    return math.lcm(q, 256)


def full_recompute_peak(cfg: Config, dispatcher: str, **kw):
    return worst_stage_peak(cfg, dispatcher, **kw)


def max_seq_length(cfg: Config, dispatcher: str, usable: int, ring_mode=None, **kw) -> int:
    """Largest multiple of ``seq_quantum`` whose full-recompute peak fits (0: none fits).
    ``ring_mode`` None: the config's (``auto``: re-chosen at every length, as the runtime)."""
    q = seq_quantum(cfg)

    def fits(n):
        pk = full_recompute_peak(cfg, dispatcher, seq=n * q, ring_mode=ring_mode, **kw)
        return pk.total <= usable

    return _largest(fits, SEQ_LIMIT // q) * q


def policy_max_seq(
    cfg: Config,
    dispatcher: str,
    policy: str,
    usable: int,
    *,
    fused_loss: bool | None = None,
    transformer_impl: str = mm.TE_IMPL,
) -> int:
    """Longest multiple of ``seq_quantum`` whose peak under recompute ``policy``
    (``policies.POLICIES``) fits ``usable`` bytes (0: none fits). The ring's selective policy
    (the recompute plan) fits exactly where full recompute does: the plan keeps layers only
    within the budget full recompute leaves."""
    pol.check_policy(policy)
    q = seq_quantum(cfg)
    if policy == "selective" and dispatcher == "ring":
        policy = "full"

    def fits(n: int) -> bool:
        pk = pol.policy_peak(
            cfg, dispatcher, policy, usable=usable, seq=n * q, fused_loss=fused_loss,
            transformer_impl=transformer_impl,
        )  # fmt: skip
        return pk is not None and pk.total <= usable

    return _largest(fits, SEQ_LIMIT // q) * q


def policy_report(cfg: Config, usable: int, transformer_impl: str = mm.TE_IMPL) -> dict:
    """Per variant and recompute policy: ``max_seq`` (``policy_max_seq``), the ``binding_term``
    there and the peak's ``terms`` (None where nothing fits)."""
    out: dict[str, dict] = {}
    for name, (disp, fused) in VARIANTS.items():
        out[name] = {}
        for policy in pol.POLICIES:
            n = policy_max_seq(
                cfg, disp, policy, usable, fused_loss=fused, transformer_impl=transformer_impl
            )
            pk = None
            if n:
                pk = pol.policy_peak(
                    cfg, disp, policy, usable=usable, seq=n, fused_loss=fused,
                    transformer_impl=transformer_impl,
                )  # fmt: skip
            out[name][policy] = {
                "max_seq": n,
                "binding_term": binding_term(pk.terms) if pk else None,
                "terms": pk.terms if pk else None,
            }
    return out


def max_micro_batch(cfg: Config, dispatcher: str, usable: int, ring_mode=None, **kw) -> int:
    def fits(b):
        pk = full_recompute_peak(cfg, dispatcher, mbs=b, ring_mode=ring_mode, **kw)
        return pk.total <= usable

    return _largest(fits, MBS_LIMIT)


def _largest(fits, hi: int) -> int:
    """Largest n in [1, hi] with fits(n) for a monotone predicate; 0 when fits(1) is false."""
    if not fits(1):
        return 0
    lo, n = 1, 2
    while n <= hi and fits(n):
        lo, n = n, n * 2
    hi = min(n - 1, hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan(
    cfg: Config,
    gpu_bytes: int | str = DEFAULT_GPU,
    *,
    notes: Sequence[str] = (),
    transformer_impl: str = mm.TE_IMPL,
) -> Plan:
    """Plans ``cfg`` on GPUs of ``gpu_bytes`` (bytes or a preset name). Raises ValueError
    (one clear message) when the config's dispatcher cannot fit even with full recompute.

    ``Plan.megatron_flags`` are the config's own flags (``to_megatron_args(cfg)``, what
    ``relaymoe flags`` prints for the same config): the ring mode as configured (``auto`` is
    resolved by the runtime, with the same cost model that gives ``routing_mode``) and the
    config's recompute. The planner's recompute is ``planned_recompute_flags``; a note says
    when it differs from the config's and how to use it. ``notes``: lines to print first (the
    command line's override notes). ``Plan.policies``: each variant's longest sequence under
    each recompute policy (``policies.py``) with Megatron's ``transformer_impl``; where the
    config's dispatcher is alltoall, ``Plan.mcore_memory_flags`` are megatron-core's own."""
    gpu = parse_gpu(gpu_bytes)
    usable = usable_bytes(gpu)
    sh = mm.shapes(cfg)
    schedule = pm.ring_schedule(cfg)
    transport = pm.resolve_transport(
        cfg.relaymoe.transport, sh.R, across_nodes=pm.across_nodes(cfg)
    )
    mode = pm.ring_mode(cfg)
    # hop times of the ring mode that runs (the faster ring mode when alltoall does)
    hop_mode = mode if mode in RING_MODES else pm.ring_mode(sh, transport=transport, ring_only=True)
    moe_peak = {
        "alltoall": mm.moe_peak_alltoall(sh),
        "ring": mm.moe_peak_ring(sh, mode, transport),
        **{f"ring_{m}": mm.moe_peak_ring(sh, m, transport) for m in MODES},
    }
    chosen_disp = "ring" if cfg.relaymoe.dispatcher == "ring" else "alltoall"
    chosen = variant_name(chosen_disp, cfg.relaymoe.fused_loss)
    plans: dict[str, dict | None] = {}
    peaks: dict[str, int | None] = {}
    full: dict[str, int] = {}
    breakdown: dict[str, dict] = {}
    max_seq: dict[str, int] = {}
    max_mbs: dict[str, int] = {}
    at_max_seq: dict[str, dict | None] = {}
    notes = list(notes)
    rp_chosen: RecomputePlan | None = None
    for name, (disp, fused) in VARIANTS.items():
        kw = {"fused_loss": fused}
        full[name] = full_recompute_peak(cfg, disp, ring_mode=mode, **kw).total
        # the runtime re-chooses an auto mode at every length and micro-batch
        max_seq[name] = max_seq_length(cfg, disp, usable, **kw)
        max_mbs[name] = max_micro_batch(cfg, disp, usable, **kw)
        at_max_seq[name] = None
        if max_seq[name]:
            pk = full_recompute_peak(cfg, disp, seq=max_seq[name], **kw)
            at_max_seq[name] = {"seq": max_seq[name], "stage": pk.stage, "terms": pk.terms}
        try:
            rp = plan_recompute(cfg, disp, usable, ring_mode=mode, **kw)
        except ValueError as e:
            if name == chosen:
                raise
            plans[name], peaks[name] = None, None
            breakdown[name] = full_recompute_peak(cfg, disp, ring_mode=mode, **kw).terms
            notes.append(f"{name}: {e}")
            continue
        kept = frozenset(rp.kept_layers)
        pk = worst_stage_peak(cfg, disp, kept, ring_mode=mode, **kw)
        plans[name], peaks[name], breakdown[name] = rp.to_dict(), pk.total, pk.terms
        if name == chosen:
            rp_chosen = rp
        if not rp.megatron_expressible:
            notes.append(
                f"{name}: the per-layer choice (kept layers {list(rp.kept_layers)}) is finer "
                "than Megatron's block method; the flags keep the same number of layers"
            )
    assert rp_chosen is not None
    overrides = rp_chosen.megatron_overrides()
    planned = recompute_args(
        overrides["recompute_granularity"], overrides["recompute_method"],
        overrides["recompute_num_layers"], overrides["recompute_modules"],
    )  # fmt: skip
    note = _recompute_note(cfg, chosen, planned)
    if note:
        notes.append(note)
    flags = tuple(to_megatron_args(cfg))
    return Plan(
        config_name=cfg.name,
        world_size=cfg.parallel.world_size,
        gpu_bytes=gpu,
        usable_bytes=usable,
        dispatcher=chosen_disp,
        fused_loss=cfg.relaymoe.fused_loss,
        routing_mode=mode,
        transport=transport,
        per_hop_bytes=pm.per_hop_bytes(sh),
        step_model=pm.step_report(sh, transport),
        schedule=schedule,
        gpus_per_node=cfg.parallel.gpus_per_node,
        hop_times=pm.hop_time_report(sh, hop_mode, transport, pm.ep_ranks_per_node(cfg.parallel)),
        moe_peak_bytes=moe_peak,
        peak_bytes=peaks,
        peak_full_recompute_bytes=full,
        breakdown=breakdown,
        recompute_plans=plans,
        max_seq_length=max_seq,
        max_micro_batch_size=max_mbs,
        max_seq_breakdown=at_max_seq,
        megatron_args=overrides,
        megatron_flags=flags,
        planned_recompute_flags=tuple(planned),
        notes=tuple(notes),
        transformer_impl=transformer_impl,
        policies=policy_report(cfg, usable, transformer_impl),
        mcore_memory_flags=tuple(pol.mcore_memory_flags() if chosen_disp == "alltoall" else ()),
    )


def _recompute_note(cfg: Config, variant: str, planned: list[str]) -> str | None:
    """The line saying that the planner's recompute differs from the config's (None when the
    same), and how to get it: the config's flags stay the flags (one source of truth with
    ``relaymoe flags``); ``--relaymoe-recompute-planner`` applies the plan at launch."""
    t = cfg.training
    configured = recompute_args(
        t.recompute_granularity, t.recompute_method, t.recompute_num_layers, t.recompute_modules
    )
    if planned == configured:
        return None
    shown = " ".join(planned) or "no recompute flags (every layer kept)"
    if cfg.relaymoe.recompute_planner:
        how = "--relaymoe-recompute-planner (in the flags) applies it at launch"
    else:
        how = (
            "to use it, put these in place of the config's, or launch with "
            "--relaymoe-recompute-planner (relaymoe.recompute_planner: true), which applies it"
        )
    return (
        f"{variant}: the recompute planner's plan is {shown}; the flags keep the config's "
        f"({' '.join(configured) or 'no recompute'}); {how}"
    )


# -- Megatron integration ----------------------------------------------------------------------


def config_from_megatron_args(args, kernels: KernelOptions | None = None) -> Config:
    """A Config from an argparse Namespace of Megatron arguments (attribute names as Megatron's,
    after ``validate_args``); ``kernels``: the run's kernel options where no flag sets them
    (the entry point's ``relaymoe.options.from_env().kernels``; None: the defaults)."""

    def g(name, default=None):
        v = getattr(args, name, default)
        return default if v is None else v

    heads = g("num_attention_heads")
    groups = g("num_query_groups") if g("group_query_attention", False) else heads
    vocab = g("padded_vocab_size") or g("vocab_size")
    if vocab is None:
        raise ValueError(
            "the recompute planner needs the vocabulary size: Megatron args have neither "
            "padded_vocab_size nor vocab_size (run it after the tokenizer is built)"
        )
    tp, cp, pp = (
        g("tensor_model_parallel_size", 1),
        g("context_parallel_size", 1),
        g("pipeline_model_parallel_size", 1),
    )
    dp = g("data_parallel_size") or max(1, g("world_size", tp * cp * pp) // (tp * cp * pp))
    la = g("linear_attention_freq")
    model = {
        "num_layers": g("num_layers"),
        "hidden_size": g("hidden_size"),
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": g("kv_channels"),
        "num_experts": g("num_experts"),
        "moe_router_topk": g("moe_router_topk"),
        "moe_ffn_hidden_size": g("moe_ffn_hidden_size") or g("ffn_hidden_size"),
        "ffn_hidden_size": g("ffn_hidden_size"),
        "vocab_size": vocab,
        "make_vocab_size_divisible_by": 1 if g("padded_vocab_size") else 128,
        "moe_shared_expert_intermediate_size": g("moe_shared_expert_intermediate_size"),
        "untie_embeddings_and_output_weights": bool(g("untie_embeddings_and_output_weights", 0)),
        "qk_layernorm": bool(g("qk_layernorm", False)),
        "attention_output_gate": bool(g("attention_output_gate", False)),
        "moe_layer_freq": g("moe_layer_freq", 1),
        "experimental_attention_variant": g("experimental_attention_variant"),
        "linear_attention_freq": la,
        # the expert MLP (gated: fc1 of 2*ffn rows; biases): SwiGLU without biases when the
        # namespace does not say
        "swiglu": bool(g("swiglu", True)),
        "disable_bias_linear": not g("add_bias_linear", False),
    }
    if g("experimental_attention_variant") == "gated_delta_net":
        for k in (
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        ):
            if g(k) is not None:
                model[k] = g(k)
    model = {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.items() if v is not None}
    vpp = g("virtual_pipeline_model_parallel_size")
    parallel = {
        "tp": tp,
        "cp": cp,
        "pp": pp,
        "vpp": vpp,
        "ep": g("expert_model_parallel_size", 1),
        "etp": g("expert_tensor_parallel_size") or tp,
        "dp": dp,
        "sequence_parallel": bool(g("sequence_parallel", False)),
        "use_distributed_optimizer": bool(g("use_distributed_optimizer", False)),
        "gpus_per_node": g("relaymoe_gpus_per_node"),
    }
    precision = "bf16" if g("bf16", False) else "fp16" if g("fp16", False) else "fp32"
    training = {
        "seq_length": g("seq_length"),
        "micro_batch_size": g("micro_batch_size", 1),
        "global_batch_size": g("global_batch_size"),
        "precision": precision,
        "normalization_impl": normalization_impl_of(args),
        # Megatron's default; --no-gradient-accumulation-fusion sets it False
        "gradient_accumulation_fusion": bool(g("gradient_accumulation_fusion", True)),
    }
    disp = g("moe_token_dispatcher_type", "alltoall")
    relay = {
        "dispatcher": "ring" if disp == "ring" else "alltoall",
        "mode": g("relaymoe_mode", None) or "auto",
        "transport": g("relaymoe_transport", "auto"),
        # the flag, else the run's own value (its RELAYMOE_HOP_SLICE_MIB, read by the entry
        # point into ``kernels``), else the default
        "hop_slice_mib": g("relaymoe_hop_slice_mib", (kernels or KernelOptions()).hop_slice_mib),
        "fused_loss": bool(g("relaymoe_fused_loss", False)),
    }
    return config_from_dict(
        {"model": model, "parallel": parallel, "training": training, "relaymoe": relay},
        name="megatron-args",
    )


def normalization_impl_of(args) -> str:
    """How a Megatron run normalises: ``--transformer-impl local`` builds apex's fused norms
    when apex is importable and megatron-core's torch fallback otherwise ("torch", or
    "torch_composite" when the torch already imported lacks ``aten::_fused_rms_norm``);
    TransformerEngine (Megatron's default impl) fuses them. Looks for apex with
    ``importlib.util.find_spec`` (nothing imported)."""
    impl = getattr(args, "transformer_impl", None) or "transformer_engine"
    if impl == "local" and importlib.util.find_spec("apex") is None:
        torch = sys.modules.get("torch")
        if torch is not None and not hasattr(torch.ops.aten, "_fused_rms_norm"):
            return "torch_composite"
        return "torch"
    return "fused"


def plan_from_megatron_args(args, gpu_bytes: int | str | None = None,
                            kernels: KernelOptions | None = None) -> Plan:  # fmt: skip
    """The plan for a Megatron run (called once at training start). GPU memory: ``gpu_bytes``
    (the Megatron patch passes ``$RELAYMOE_GPU_BYTES``), else the current CUDA device's total
    memory; ``kernels``: as :func:`config_from_megatron_args`'. Deterministic: every rank
    computes the same plan from the same arguments."""
    if gpu_bytes is None:
        import torch  # only here: the planner itself is pure Python

        if not torch.cuda.is_available():
            raise ValueError(
                "the recompute planner needs the GPU memory size: no CUDA device; pass "
                "gpu_bytes (for --relaymoe-recompute-planner: set RELAYMOE_GPU_BYTES)"
            )
        gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    impl = getattr(args, "transformer_impl", None) or mm.TE_IMPL
    return plan(
        config_from_megatron_args(args, kernels),
        int(gpu_bytes) if str(gpu_bytes).isdigit() else gpu_bytes,
        transformer_impl=impl if impl in mm.TRANSFORMER_IMPLS else mm.TE_IMPL,
    )
