"""A Qwen3-MoE ``config.json``: read and checked, as Megatron's model flags, against a config.

Only what the conversion supports is accepted (``read_hf_config`` names the first key that is
not); ``megatron_model_flags`` are the architecture flags relaymoe's configs render.
"""

from __future__ import annotations

import json
from pathlib import Path

from relaymoe.convert_hf.errors import ConvertError

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)


def read_hf_config(hf_dir: str) -> dict:
    path = Path(hf_dir, "config.json")
    if not path.is_file():
        raise ConvertError(
            f"--hf {hf_dir}: no config.json; pass the folder of a downloaded Hugging Face "
            "checkpoint (config.json + *.safetensors), e.g. Qwen/Qwen3-30B-A3B"
        )
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: not JSON ({e}); pass the folder of a Hugging Face "
                           "checkpoint as downloaded") from None  # fmt: skip
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: a JSON {type(cfg).__name__}, not a model config object")
    kind = cfg.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ConvertError(
            f"{path}: model_type {kind!r}; relaymoe convert-hf converts {SUPPORTED_MODEL_TYPES} "
            "(Qwen3-MoE: Qwen3-30B-A3B, Qwen3-235B-A22B)"
        )
    unsupported = {
        "attention_bias": (cfg.get("attention_bias", False), False),
        "use_sliding_window": (cfg.get("use_sliding_window", False), False),
        "rope_scaling": (_rope(cfg).get("rope_type", "default"), "default"),
        "hidden_act": (cfg.get("hidden_act", "silu"), "silu"),
    }
    # the Hub's Qwen3-MoE configs say num_experts, transformers >= 5 writes num_local_experts
    if "num_experts" not in cfg and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "vocab_size"):  # fmt: skip
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ConvertError(f"{path}: {key}={cfg.get(key)!r}, expected a positive integer")
    for key, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ConvertError(
                f"{path}: {key}={value!r}; the conversion supports {key}={wanted!r} only "
                "(what Qwen3-MoE checkpoints have)"
            )
    return cfg


def _rope(cfg: dict) -> dict:
    """rope parameters of either transformers generation (rope_parameters or rope_theta +
    rope_scaling)."""
    rp = dict(cfg.get("rope_parameters") or {})
    if "rope_theta" not in rp and "rope_theta" in cfg:
        rp["rope_theta"] = cfg["rope_theta"]
    if cfg.get("rope_scaling"):
        rp.setdefault("rope_type", cfg["rope_scaling"].get("rope_type", "scaled"))
    return rp


def moe_layer_pattern(cfg: dict) -> list[int]:
    """1 for a sparse (MoE) layer, 0 for a dense one, as transformers' Qwen3-MoE decides."""
    n = cfg["num_hidden_layers"]
    dense = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    return [0 if (i in dense or (i + 1) % step) else 1 for i in range(n)]


def megatron_model_flags(cfg: dict) -> list[str]:
    """The Megatron model flags of a Qwen3-MoE ``config.json`` (the same architecture flags
    relaymoe's configs render; ``--padded-vocab-size`` keeps the embedding at the checkpoint's
    rows whatever the tokenizer's length)."""
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    vocab = cfg["vocab_size"]
    pattern = moe_layer_pattern(cfg)
    flags = [
        "--num-layers", str(cfg["num_hidden_layers"]),
        "--hidden-size", str(cfg["hidden_size"]),
        "--ffn-hidden-size", str(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),
        "--num-attention-heads", str(heads),
        "--kv-channels", str(head_dim),
        "--num-experts", str(cfg["num_experts"]),
        "--moe-router-topk", str(cfg["num_experts_per_tok"]),
        "--moe-ffn-hidden-size", str(cfg["moe_intermediate_size"]),
        "--vocab-size", str(vocab),
        "--padded-vocab-size", str(vocab),
        "--max-position-embeddings", str(cfg.get("max_position_embeddings", 4096)),
        "--position-embedding-type", "rope",
        "--rotary-base", str(int(_rope(cfg).get("rope_theta", 10000))),
        "--normalization", "RMSNorm",
        "--norm-epsilon", repr(float(cfg.get("rms_norm_eps", 1e-6))),
        "--qk-layernorm",
        "--swiglu",
        "--disable-bias-linear",
        "--moe-grouped-gemm",
        "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", repr(float(cfg.get("router_aux_loss_coef", 1e-3))),
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
    ]  # fmt: skip
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    if not cfg.get("tie_word_embeddings", False):
        flags.append("--untie-embeddings-and-output-weights")
    if not cfg.get("norm_topk_prob", True):
        # softmax over all experts, top-k of those probabilities, not renormalised
        flags.append("--moe-router-pre-softmax")
    if 0 in pattern:
        flags += ["--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"]
    return flags


def architecture(cfg: dict) -> dict:
    """What decides the function a Qwen3-MoE ``config.json`` describes, in one form whatever
    transformers generation wrote it (``num_experts`` or ``num_local_experts``, ``rope_theta`` or
    ``rope_parameters``, a sparse step or ``mlp_only_layers``): two checkpoints of equal
    ``architecture`` hold tensors of the same names and shapes that compute the same way."""
    heads = cfg["num_attention_heads"]
    pattern = moe_layer_pattern(cfg)
    arch = {
        "num_hidden_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "num_experts": cfg.get("num_experts", cfg.get("num_local_experts")),
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "rope_theta": float(_rope(cfg).get("rope_theta", 10000)),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "moe_layer_pattern": pattern,
    }
    if 0 in pattern:  # only dense layers use it
        arch["intermediate_size"] = cfg["intermediate_size"]
    return arch


def architecture_differences(first: dict, second: dict, names: tuple[str, str]) -> list[str]:
    """Each field where two ``config.json`` files describe different functions, as
    ``"field: <names[0]> value, <names[1]> value"`` (empty when they describe the same)."""
    a, b = architecture(first), architecture(second)
    return [
        f"{k}: {names[0]} {a.get(k)!r}, {names[1]} {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


# relaymoe config model keys -> what a Qwen3-MoE config.json says about them
def _hf_model_fields(cfg: dict) -> dict:
    heads = cfg["num_attention_heads"]
    return {
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_attention_heads": heads,
        "query_groups": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "num_experts": cfg["num_experts"],
        "moe_router_topk": cfg["num_experts_per_tok"],
        "moe_ffn_hidden_size": cfg["moe_intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        "qk_layernorm": True,
        "rotary_base": int(_rope(cfg).get("rope_theta", 10000)),
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "moe_layer_pattern": tuple(moe_layer_pattern(cfg)),
    }


def check_against_config(cfg: dict, config_name: str) -> None:
    """ConvertError unless the relaymoe config's model is the checkpoint's architecture."""
    from relaymoe.config import load_config

    try:
        model = load_config(config_name).model
    except ValueError as e:  # no such config, or not a valid one
        raise ConvertError(f"--config {config_name}: {e}") from None
    bad = []
    for key, want in _hf_model_fields(cfg).items():
        have = getattr(model, key)
        if isinstance(want, float) and abs(have - want) <= 1e-12 * max(1.0, abs(want)):
            continue
        if have != want:
            bad.append(f"{key}: config {have!r}, checkpoint {want!r}")
    if bad:
        raise ConvertError(
            f"config {config_name} is not this checkpoint's architecture ({'; '.join(bad)}); "
            "fix: pass the matching config, or train with the flags convert-hf prints"
        )
