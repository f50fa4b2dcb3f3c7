"""Recompute policies: the Megatron flags of each and the planner's memory of each (pure Python).

``benchmarks/max_seq.py`` measures every provider under these policies and ``relaymoe plan``
predicts the same ones, both from this module: a policy's flags are written once, here.

* ``full``: every layer recomputed, one layer a checkpoint (``--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1``): the least memory a layer can keep.
* ``selective``: each dispatcher's own best memory set.

  - megatron-core (alltoall): ``--recompute-granularity selective --recompute-modules moe_act
    layernorm core_attn moe`` (``MCORE_SELECTIVE_MODULES``). Fine-grained activation offloading
    (``--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act``) is not
    part of it: megatron-core 0.19's ``TransformerConfig.__post_init__`` refuses offloading
    ``expert_fc1`` or ``moe_act`` while ``moe`` is recomputed ("'moe' in recompute_modules
    wraps the full MoE forward in a checkpoint, so offloading activations inside it is
    redundant"), and recomputing the whole MoE layer already keeps less on the GPU than
    offloading two of its inputs would (only the layer's input stays). The training arguments
    accept offloading only under TransformerEngine (and, from TE 2.10, only with
    ``NVTE_CPU_OFFLOAD_V1=1``). So ``MCORE_OFFLOAD_MODULES`` is empty and no offloading flag is
    passed.
  - relaymoe's ring: the recompute plan ``relaymoe plan`` prints for the GPU (its
    ``planned_recompute_flags``: full recompute of the first N layers by Megatron's block
    method, the others kept, by compute saved per byte; ``relaymoe.planner.recompute``). The
    ring keeps no expert activations whatever the flags (it recomputes per hop), so what
    megatron-core's set saves inside the MoE layer it saves already; the plan spends the
    memory left on keeping whole layers. Where even full recompute does not fit, the plan is
    full recompute, so its longest sequence is full recompute's.
* ``none``: no recompute flags: every layer keeps all its activations.

Beside the policies, megatron-core as a user runs it fuses its cross-entropy:
``MCORE_FUSED_CE_FLAGS`` (``--cross-entropy-fusion-impl native``: megatron-core 0.19's
arguments refuse ``te``, "disabled due to stability issues"). ``mcore_memory_flags`` is the
whole alternative ``relaymoe plan`` prints where the dispatcher is alltoall.
"""

from __future__ import annotations

from relaymoe.config import Config, recompute_args
from relaymoe.planner import memory as mm
from relaymoe.planner.recompute import StagePeak, plan_recompute, worst_stage_peak

POLICIES = ("full", "selective", "none")
FULL_RECOMPUTE = ("full", "uniform", 1)  # granularity, method, layers per checkpoint
MCORE_SELECTIVE_MODULES = ("moe_act", "layernorm", "core_attn", "moe")
MCORE_OFFLOAD_MODULES: tuple[str, ...] = ()  # refused beside "moe" by megatron-core 0.19
MCORE_FUSED_CE_FLAGS = ("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native")
# every Megatron flag that sets recompute: a policy's flags replace all of them
RECOMPUTE_FLAGS = (
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--recompute-modules",
    "--recompute-activations",
    "--fine-grained-activation-offloading",
    "--offload-modules",
)


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r}; known: {', '.join(POLICIES)}")


def offload_flags() -> list[str]:
    """megatron-core's fine-grained activation offloading of ``MCORE_OFFLOAD_MODULES`` (none)."""
    if not MCORE_OFFLOAD_MODULES:
        return []
    return ["--fine-grained-activation-offloading", "--offload-modules", *MCORE_OFFLOAD_MODULES]


def policy_flags(policy: str, dispatcher: str, planned: tuple[str, ...] | None = None) -> list[str]:
    """The recompute flags of ``policy`` for ``dispatcher`` (``ring`` or ``alltoall``).
    ``planned``: the ring's selective policy, the plan's ``planned_recompute_flags`` (the caller
    asks ``relaymoe.planner.plan`` for the GPU and the sequence); required there."""
    check_policy(policy)
    if policy == "full":
        return recompute_args(*FULL_RECOMPUTE)
    if policy == "none":
        return []
    if dispatcher == "ring":
        if planned is None:
            raise ValueError(
                "the ring's selective policy is the recompute plan for the GPU: pass its "
                "planned_recompute_flags (relaymoe.planner.plan(cfg, gpu))"
            )
        return list(planned)
    return recompute_args("selective", modules=MCORE_SELECTIVE_MODULES) + offload_flags()


def mcore_memory_flags() -> list[str]:
    """megatron-core's own memory flags as ``relaymoe plan`` prints them for an alltoall user:
    the selective set (offloading where megatron-core accepts it) and the fused cross-entropy."""
    return policy_flags("selective", "alltoall") + list(MCORE_FUSED_CE_FLAGS)


def policy_peak(
    cfg: Config, dispatcher: str, policy: str, *, usable: int, seq: int | None = None,
    fused_loss: bool | None = None, transformer_impl: str = mm.TE_IMPL,
) -> StagePeak | None:  # fmt: skip
    """The worst stage's peak of ``cfg`` under ``policy`` at ``seq`` (default the config's).
    The ring's selective policy is the recompute plan for ``usable`` bytes at that sequence;
    None where the plan itself does not fit (full recompute does not)."""
    check_policy(policy)
    kw = {"seq": seq, "fused_loss": fused_loss}
    if policy == "full":
        return worst_stage_peak(cfg, dispatcher, **kw)
    if policy == "none":
        every = frozenset(range(cfg.model.num_layers))
        return worst_stage_peak(cfg, dispatcher, every, **kw)
    if dispatcher != "ring":
        return worst_stage_peak(
            cfg, dispatcher, recompute_modules=MCORE_SELECTIVE_MODULES,
            transformer_impl=transformer_impl, **kw,
        )  # fmt: skip
    at = cfg if seq is None else cfg.replace(training={"seq_length": seq})
    try:
        rp = plan_recompute(at, dispatcher, usable, fused_loss=fused_loss)
    except ValueError:  # full recompute does not fit: neither does any plan
        return None
    return worst_stage_peak(at, dispatcher, frozenset(rp.kept_layers), fused_loss=fused_loss)
