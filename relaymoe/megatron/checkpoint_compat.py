"""Which checkpoints a model of one layer implementation can load: refusals by name, and the TE
state a converted checkpoint lacks.

megatron-core 0.19.2 names one tensor of every MoE layer differently in the two layer specs: the
norm before the MoE block is ``pre_mlp_layernorm.weight`` in the TransformerEngine spec (a
separate ``TENorm``, since no grouped linear can fuse it), while the local spec maps it to
``mlp.linear_fc1.layer_norm_weight`` (the key a dense TE layer's fused norm would have). Dense
layers, attention and the experts themselves are interchangeable between the specs
(``SequentialMLP`` and ``TEGroupedMLP`` write the same sharded keys), but a model of one spec
finds no pre-MoE norm in a checkpoint of the other and the load stops on missing keys, deep in
the distributed-checkpoint code. ``impl_mismatch`` names the cause and the fix instead, before
any tensor is read; ``register()`` checks it on the common state Megatron loads first.

A checkpoint of ``relaymoe convert-hf`` for ``--transformer-impl transformer_engine`` has the TE
spec's tensor keys but no TE ``_extra_state`` (it is built from the local layers on a host without
TE); ``drop_absent_extra_state`` lets a TE model load it with its modules' fresh state.
"""

from __future__ import annotations

__all__ = [
    "CONVERTED_MARK",
    "TE_IMPL",
    "converted_by_relaymoe",
    "drop_absent_extra_state",
    "impl_mismatch",
]

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


# ----------------------------------------------------------- checkpoints of relaymoe convert-hf
CONVERTED_MARK = "relaymoe_convert_hf"  # set in the saved arguments of a convert-hf checkpoint
EXTRA_STATE = "_extra_state"


def converted_by_relaymoe(ckpt_args) -> bool:
    """Whether the checkpoint whose saved arguments are ``ckpt_args`` was written by
    ``relaymoe convert-hf`` (which builds the local layers and so writes no TE ``_extra_state``)."""
    return bool(getattr(ckpt_args, CONVERTED_MARK, False))


def drop_absent_extra_state(sharded_state_dict: dict, saved_keys) -> list[str]:
    """Leave out of ``sharded_state_dict`` (in place) every ``_extra_state`` object whose key the
    checkpoint lacks; returns their keys, sorted.

    TransformerEngine modules checkpoint their fp8 scaling state as ``<module>._extra_state``
    objects; a checkpoint converted from Hugging Face weights has none (nothing ran in fp8), so a
    TE model's load would stop on the first of them. Left out here, each TE module keeps its
    fresh state (megatron-core's model load falls back to a non-strict ``load_state_dict`` for
    exactly these keys). Any other key the checkpoint lacks is not touched: its load still
    fails, as it should. ``saved_keys``: the checkpoint's sharded keys
    (``dist_checkpointing.load_sharded_metadata``)."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    saved = set(saved_keys)

    def absent(x) -> bool:
        return isinstance(x, ShardedObject) and x.key.endswith(EXTRA_STATE) and x.key not in saved

    dropped: set[str] = set()
    for name in [k for k in sharded_state_dict if k.startswith("model")]:  # model, model0, ...
        part = sharded_state_dict[name]
        if isinstance(part, dict):
            gone, sharded_state_dict[name] = extract_matching_values(part, absent)
            dropped.update(x.key for x in nested_values(gone))
    return sorted(dropped)
