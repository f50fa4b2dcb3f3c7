"""Memory model, routing-mode choice and selective-recompute planner (pure Python; no torch).

``plan(cfg, gpu_bytes) -> Plan``; ``plan_from_megatron_args(args) -> Plan`` at training start;
``ring_mode(cfg)``: the mode the runtime picks for a config (``relaymoe.cost.choose_mode``);
``ring_schedule(cfg)``: its schedule for the cluster shape (``cost.choose_schedule``).
``VARIANTS``: what a plan compares (alltoall / ring, each with Megatron's loss or the fused one).
"""

from relaymoe.planner.mode import per_hop_bytes, ring_mode, ring_schedule
from relaymoe.planner.plan import (
    DEFAULT_GPU,
    GPUS,
    VARIANTS,
    Plan,
    config_from_megatron_args,
    max_micro_batch,
    max_seq_length,
    parse_gpu,
    plan,
    plan_from_megatron_args,
    usable_bytes,
)
from relaymoe.planner.recompute import RecomputePlan, plan_recompute, stage_peak, worst_stage_peak

__all__ = [
    "DEFAULT_GPU",
    "GPUS",
    "Plan",
    "VARIANTS",
    "RecomputePlan",
    "config_from_megatron_args",
    "max_micro_batch",
    "max_seq_length",
    "parse_gpu",
    "per_hop_bytes",
    "plan",
    "plan_from_megatron_args",
    "plan_recompute",
    "ring_mode",
    "ring_schedule",
    "stage_peak",
    "usable_bytes",
    "worst_stage_peak",
]
