"""The Qwen3-MoE ``config.json`` of a Megatron checkpoint, from the arguments its run saved.

The inverse of ``relaymoe.convert_hf.hf_config.megatron_model_flags``: what that function turns
into Megatron flags, ``hf_config`` turns back (a round trip through both gives the same
``architecture``, which the tests check). The model the arguments describe, with Megatron's
defaults for what they leave out, is ``relaymoe.megatron.checkpoint_compat.model_settings``'s,
the reading train.sh's preflight compares checkpoints by. A checkpoint whose arguments ask for
something a Qwen3-MoE model does not have (another activation, biases, shared experts, another
router, ...) is refused by the argument's name: transformers' ``Qwen3MoeForCausalLM`` would
load such a folder and compute something else.
"""

from __future__ import annotations

from relaymoe.export_hf.errors import ExportError
from relaymoe.megatron.checkpoint_compat import model_settings


def _off(value) -> bool:
    return value in (None, False, 0, 0.0, "")


# (saved argument, whether its value is one Qwen3-MoE has, what it is: the flag)
QWEN3_MOE_ARGS = (
    ("swiglu", lambda v: v is True, "the SiLU-gated expert activation (--swiglu)"),
    ("squared_relu", _off, "a squared-ReLU activation (--squared-relu)"),
    ("quick_geglu", _off, "a quick-GeGLU activation (--quick-geglu)"),
    ("glu_linear_offset", _off, "a GLU linear offset (--glu-linear-offset)"),
    ("activation_func_clamp_value", _off, "a clamped activation (--activation-func-clamp-value)"),
    (
        "moe_mlp_glu_interleave_size",
        _off,
        "interleaved gate/up rows (--moe-mlp-glu-interleave-size)",
    ),
    ("add_bias_linear", _off, "linear-layer biases (--add-bias-linear)"),
    ("add_qkv_bias", _off, "QKV biases (--add-qkv-bias)"),
    ("qk_layernorm", lambda v: v is True, "q/k norms (--qk-layernorm)"),
    ("qk_l2_norm", _off, "q/k L2 norms (--qk-l2-norm)"),
    ("normalization", lambda v: v == "RMSNorm", "RMSNorm (--normalization RMSNorm)"),
    ("layernorm_zero_centered_gamma", _off, "zero-centred norm weights"),
    ("apply_residual_connection_post_layernorm", _off, "post-norm residuals"),
    ("position_embedding_type", lambda v: v == "rope", "RoPE (--position-embedding-type rope)"),
    ("rotary_percent", lambda v: v in (None, 1.0), "RoPE on every channel (--rotary-percent 1)"),
    ("rotary_interleaved", _off, "interleaved RoPE (--rotary-interleaved)"),
    ("use_rope_scaling", _off, "RoPE scaling (--use-rope-scaling)"),
    ("rotary_seq_len_interpolation_factor", _off, "RoPE interpolation"),
    ("no_rope_freq", _off, "layers without RoPE (--no-rope-freq)"),
    ("window_size", _off, "sliding-window attention (--window-size)"),
    ("multi_latent_attention", _off, "multi-latent attention"),
    ("attention_output_gate", _off, "a gated attention output (--attention-output-gate)"),
    ("softmax_type", lambda v: v in (None, "vanilla"), "vanilla attention softmax"),
    ("experimental_attention_variant", _off, "another attention variant"),
    ("linear_attention_freq", _off, "linear-attention layers"),
    ("heterogeneous_layers_config_path", _off, "heterogeneous layers"),
    ("moe_shared_expert_intermediate_size", _off, "shared experts"),
    ("moe_router_score_function", lambda v: v in (None, "softmax"), "softmax router scores"),
    ("moe_router_enable_expert_bias", _off, "a router expert bias (aux-loss-free balancing)"),
    ("moe_router_num_groups", _off, "group-limited routing (--moe-router-num-groups)"),
    ("moe_router_topk_scaling_factor", lambda v: v in (None, 1, 1.0), "scaled top-k weights"),
    ("moe_latent_size", _off, "latent MoE projections"),
    ("mtp_num_layers", _off, "multi-token-prediction layers (--mtp-num-layers)"),
)


def refusal(args) -> str | None:
    """Why the run of saved arguments ``args`` is no Qwen3-MoE model, or None when it is."""
    if not getattr(args, "num_experts", None):
        return "a dense model (no --num-experts): Qwen3-MoE has experts"
    for name, fits, what in QWEN3_MOE_ARGS:
        value = getattr(args, name, None)
        if not fits(value):
            return f"{name}={value!r} ({what}) has no Qwen3-MoE counterpart"
    return None


def hf_config(args, vocab_rows: int, dtype: str) -> dict:
    """The ``config.json`` (Hub layout, as Qwen/Qwen3-30B-A3B's) of the model the saved
    arguments ``args`` describe, with ``vocab_rows`` rows of the embedding and ``dtype`` the
    ``torch_dtype`` of the written tensors; ExportError naming the argument for what a
    Qwen3-MoE model cannot express."""
    why = refusal(args)
    if why is not None:
        raise ExportError(
            f"the checkpoint is not a Qwen3-MoE model: {why}; export-hf writes "
            "Qwen3-MoE folders only"
        )
    m = model_settings(args)  # Megatron's derived defaults (KV groups, head size) filled in
    pattern = m["moe_layer_pattern"]
    if len(pattern) != m["num_layers"]:
        raise ExportError(
            f"--moe-layer-freq {args.moe_layer_freq} has {len(pattern)} entries for "
            f"{m['num_layers']} layers"
        )
    padded = getattr(args, "padded_vocab_size", None)
    if padded is not None and padded != vocab_rows:
        raise ExportError(
            f"the saved embedding has {vocab_rows} rows but the run's "
            f"padded_vocab_size is {padded}: not this run's checkpoint?"
        )
    aux = getattr(args, "moe_aux_loss_coeff", 0.001)
    eps = getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", 1e-6)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "head_dim": m["kv_channels"],
        "hidden_act": "silu",
        "hidden_size": m["hidden_size"],
        "initializer_range": float(getattr(args, "init_method_std", 0.02)),
        "intermediate_size": m["ffn_hidden_size"],
        "max_position_embeddings": args.max_position_embeddings,
        "max_window_layers": m["num_layers"],
        "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse],
        "moe_intermediate_size": m["moe_ffn_hidden_size"] or m["ffn_hidden_size"],
        "norm_topk_prob": not getattr(args, "moe_router_pre_softmax", False),
        "num_attention_heads": m["num_attention_heads"],
        "num_experts": m["num_experts"],
        "num_experts_per_tok": m["moe_router_topk"],
        "num_hidden_layers": m["num_layers"],
        "num_key_value_heads": m["num_query_groups"],
        "output_router_logits": False,
        "rms_norm_eps": float(eps),
        "rope_scaling": None,
        "rope_theta": float(m["rotary_base"]),
        "router_aux_loss_coef": float(aux[0] if isinstance(aux, list | tuple) else aux),
        "sliding_window": None,
        "tie_word_embeddings": not m["untie_embeddings_and_output_weights"],
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_rows,
    }
