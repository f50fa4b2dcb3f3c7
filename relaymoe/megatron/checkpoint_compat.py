"""Which checkpoints a run can load: refusals by name (the layer implementation, the
architecture, the layout of a resumed optimizer), and the TE state a converted checkpoint lacks.

megatron-core 0.19.2 names one tensor of every MoE layer differently in the two layer specs: the
norm before the MoE block is ``pre_mlp_layernorm.weight`` in the TransformerEngine spec (a
separate ``TENorm``, since no grouped linear can fuse it), while the local spec maps it to
``mlp.linear_fc1.layer_norm_weight`` (the key a dense TE layer's fused norm would have). Dense
layers, attention and the experts themselves are interchangeable between the specs
(``SequentialMLP`` and ``TEGroupedMLP`` write the same sharded keys), but a model of one spec
finds no pre-MoE norm in a checkpoint of the other and the load stops on missing keys, deep in
the distributed-checkpoint code. ``impl_mismatch`` names the cause and the fix instead, before
any tensor is read; ``register()`` checks it on the common state Megatron loads first.

``architecture_mismatch`` compares the model a run builds with the one a checkpoint holds
(shapes, and the settings that give the same tensors another function: a checkpoint of another
model would load where the shapes happen to fit, or fail deep in the load where they do not);
``resume_layout_problem`` names the one reshaping Megatron refuses on a resume: the distributed
optimizer's state saved per model-parallel rank (``dp_reshardable``, the default), loaded at
another TP/PP/EP. train.sh's preflight runs all three on the checkpoint the run will read, before
anything is launched (``relaymoe/megatron/preflight.py``).

A checkpoint of ``relaymoe convert-hf`` for ``--transformer-impl transformer_engine`` has the TE
spec's tensor keys but no TE ``_extra_state`` (it is built from the local layers on a host without
TE); ``drop_absent_extra_state`` lets a TE model load it with its modules' fresh state.
"""

from __future__ import annotations

__all__ = [
    "CONVERTED_MARK",
    "TE_IMPL",
    "architecture_mismatch",
    "converted_by_relaymoe",
    "drop_absent_extra_state",
    "impl_mismatch",
    "resume_layout_problem",
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
    if converted_by_relaymoe(ckpt_args):  # made for one implementation: convert it again
        fix = (
            f"convert it again for this run, 'relaymoe convert-hf --hf HF_FOLDER --out "
            f"NEW_FOLDER --transformer-impl {now}'"
        )
    else:
        needs = " (which needs TransformerEngine installed)" if saved == TE_IMPL else ""
        fix = f"resume with --transformer-impl {saved}{needs}, the implementation it was saved with"
    return (
        f"the checkpoint was saved with --transformer-impl {saved} and this run builds "
        f"--transformer-impl {now}: megatron-core stores the norm before each MoE layer under "
        f"another key in each (local: mlp.linear_fc1.layer_norm_weight, transformer_engine: "
        f"pre_mlp_layernorm.weight), so the load would stop on missing keys; fix: {fix}"
    )


# ------------------------------------------------------------------------- architecture
def _ffn(ns) -> int | None:
    """``--ffn-hidden-size``, or Megatron's default for it (``validate_args``)."""
    ffn, h = getattr(ns, "ffn_hidden_size", None), getattr(ns, "hidden_size", None)
    if ffn is not None or h is None:
        return ffn
    return int((4 * h * 2 / 3) / 64) * 64 if getattr(ns, "swiglu", False) else 4 * h


def _moe_pattern(ns) -> tuple[int, ...] | None:
    """``--moe-layer-freq`` as one 0/1 per layer (an int N: every N-th layer, from the first)."""
    freq, layers = getattr(ns, "moe_layer_freq", 1), getattr(ns, "num_layers", None)
    if not _moe(ns) or layers is None:
        return None
    if isinstance(freq, int):
        return tuple(int(i % freq == 0) for i in range(layers))
    return tuple(int(x) for x in freq)


def model_settings(ns) -> dict:
    """The settings of Megatron arguments ``ns`` (parsed, or validated and saved in a
    checkpoint) that decide the model's tensors or what they compute, with Megatron's defaults
    for the derived ones filled in, so that both kinds compare."""
    g = lambda name, default=None: getattr(ns, name, default)  # noqa: E731
    heads, hidden = g("num_attention_heads"), g("hidden_size")
    groups = g("num_query_groups") if g("group_query_attention", False) else None
    kv = g("kv_channels") or (hidden // heads if hidden and heads else None)
    out = {
        "num_layers": g("num_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": _ffn(ns),
        "num_attention_heads": heads,
        "num_query_groups": groups or heads,
        "kv_channels": kv,
        "num_experts": g("num_experts"),
        "moe_ffn_hidden_size": g("moe_ffn_hidden_size") if _moe(ns) else None,
        "moe_router_topk": g("moe_router_topk", 2) if _moe(ns) else None,
        "moe_layer_pattern": _moe_pattern(ns),
        "moe_shared_expert_intermediate_size": g("moe_shared_expert_intermediate_size"),
        "untie_embeddings_and_output_weights": bool(g("untie_embeddings_and_output_weights")),
        "swiglu": bool(g("swiglu", False)),
        "squared_relu": bool(g("squared_relu", False)),
        "normalization": g("normalization", "LayerNorm"),
        "qk_layernorm": bool(g("qk_layernorm", False)),
        "add_bias_linear": g("add_bias_linear", True),
        "position_embedding_type": g("position_embedding_type", "learned_absolute"),
    }
    if out["position_embedding_type"] == "rope":
        out["rotary_base"] = g("rotary_base")
        out["rotary_percent"] = g("rotary_percent", 1.0)
    elif out["position_embedding_type"] == "learned_absolute":  # a table of that many rows
        out["max_position_embeddings"] = g("max_position_embeddings")
    return out


def architecture_mismatch(ckpt_args, args) -> list[str]:
    """``name: checkpoint X, this run Y`` for each model setting in which a run of Megatron
    arguments ``args`` differs from the checkpoint saved with ``ckpt_args``
    (``model_settings``; the embedding rows too, when the run fixes them with
    ``--padded-vocab-size``); empty when it builds the checkpoint's model."""
    saved, run = model_settings(ckpt_args), model_settings(args)
    rows = getattr(args, "padded_vocab_size", None)
    if rows is not None:
        saved["padded_vocab_size"] = getattr(ckpt_args, "padded_vocab_size", None)
        run["padded_vocab_size"] = rows
    return [
        f"{k}: checkpoint {saved[k]!r}, this run {run[k]!r}"
        for k in run
        if saved.get(k) is not None and run[k] is not None and not _same(saved[k], run[k])
    ]


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)))
    return a == b


# --------------------------------------------------------------------------- resume layout
# the distributed optimizer's checkpoint layouts that load at any parallel layout
# (megatron-core's DistributedOptimizer.checkpoint_fully_reshardable_formats)
FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")
_LAYOUT = (("TP", "tensor_model_parallel_size"), ("PP", "pipeline_model_parallel_size"),
           ("EP", "expert_model_parallel_size"))  # fmt: skip


def resume_layout_problem(ckpt_args, content: dict | None, args, *, release: bool,
                          finetune: bool) -> str | None:  # fmt: skip
    """Why a run of ``args`` cannot resume the distributed optimizer state of the checkpoint
    saved with ``ckpt_args`` (content metadata ``content``) at its layout, or None.

    The weights load at any TP/PP/EP (``torch_dist`` reshards them). The distributed
    optimizer's state, saved ``dp_reshardable`` (megatron-core's default), is laid out per
    model-parallel rank: megatron-core refuses it at another (TP, PP), and its keys name the
    data-parallel group, which another EP changes. Nothing of it is read from a ``release``
    checkpoint, by a ``--finetune``/``--pretrained-checkpoint`` start, with
    ``--no-load-optim``, or from a checkpoint saved without it."""
    if ckpt_args is None or release or finetune:
        return None
    if getattr(args, "no_load_optim", False) or getattr(ckpt_args, "no_save_optim", False):
        return None
    if not (getattr(args, "use_distributed_optimizer", False)
            and getattr(ckpt_args, "use_distributed_optimizer", False)):  # fmt: skip
        return None  # no distributed-optimizer state on one side: nothing laid out per rank
    sharding = (content or {}).get("distrib_optim_sharding_type", "dp_reshardable")
    if sharding in FULLY_RESHARDABLE:
        return None
    saved = {n: getattr(ckpt_args, a, 1) or 1 for n, a in _LAYOUT}
    now = {n: getattr(args, a, 1) or 1 for n, a in _LAYOUT}
    if saved == now:
        return None
    show = lambda d: " ".join(f"{n}={v}" for n, v in d.items())  # noqa: E731
    return (
        f"the checkpoint's distributed-optimizer state was saved at {show(saved)} "
        f"({sharding!r}: laid out per model-parallel rank) and this run resumes at {show(now)}, "
        f"which megatron-core cannot load; fix: resume at {show(saved)}, or pass "
        "--no-load-optim (the weights and the iteration load; the optimizer's state restarts), "
        "or save with --dist-ckpt-optim-fully-reshardable next time"
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
