"""Refusal of a checkpoint whose layer implementation the loading model cannot read.

megatron-core 0.19.2 names one tensor of every MoE layer differently in the two layer specs: the
norm before the MoE block is ``pre_mlp_layernorm.weight`` in the TransformerEngine spec (a
separate ``TENorm``, since no grouped linear can fuse it), while the local spec maps it to
``mlp.linear_fc1.layer_norm_weight`` (the key a dense TE layer's fused norm would have). Dense
layers, attention and the experts themselves are interchangeable between the specs
(``SequentialMLP`` and ``TEGroupedMLP`` write the same sharded keys), but a model of one spec
finds no pre-MoE norm in a checkpoint of the other and the load stops on missing keys, deep in
the distributed-checkpoint code. ``impl_mismatch`` names the cause and the fix instead, before
any tensor is read; ``register()`` checks it on the common state Megatron loads first.
"""

from __future__ import annotations

__all__ = ["impl_mismatch", "TE_IMPL"]

TE_IMPL = "transformer_engine"  # Megatron's default --transformer-impl


def _impl(ns) -> str:
    return getattr(ns, "transformer_impl", None) or TE_IMPL


def _moe(ns) -> bool:
    return bool(getattr(ns, "num_experts", None) or getattr(ns, "num_moe_experts", None))


def impl_mismatch(ckpt_args, args) -> str | None:
    """Why a model built from ``args`` cannot load a checkpoint saved with ``ckpt_args`` (both
    Megatron argument namespaces), or None when the layer specs agree or no MoE layer differs."""
    if ckpt_args is None or args is None or not (_moe(ckpt_args) and _moe(args)):
        return None
    saved, now = _impl(ckpt_args), _impl(args)
    if saved == now:
        return None
    return (
        f"the checkpoint was saved with --transformer-impl {saved} and this run builds "
        f"--transformer-impl {now}: megatron-core stores the norm before each MoE layer under "
        f"another key in each (local: mlp.linear_fc1.layer_norm_weight, transformer_engine: "
        f"pre_mlp_layernorm.weight), so the load would stop on missing keys; fix: resume with "
        f"--transformer-impl {saved}, the implementation the checkpoint was saved with"
    )
