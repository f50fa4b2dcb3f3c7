"""The Hugging Face tensor of every Megatron parameter of a Qwen3-MoE model.

The mapping, Hugging Face -> Megatron (names of the local spec, TP = 1):

* ``model.embed_tokens.weight`` -> ``embedding.word_embeddings.weight``;
* q/k/v_proj -> ``self_attention.linear_qkv.weight``, interleaved per query group: for each KV
  group its query heads, then its key head, then its value head (so that a TP split along
  dim 0 gives each rank whole groups);
* q_norm/k_norm -> ``self_attention.q_layernorm`` / ``k_layernorm``; o_proj -> ``linear_proj``;
* input_layernorm -> ``input_layernorm``, post_attention_layernorm -> ``pre_mlp_layernorm``;
* ``mlp.gate`` -> ``mlp.router``; expert ``j``'s [gate_proj; up_proj] -> ``linear_fc1`` (gate rows
  first, SwiGLU's order), down_proj -> ``linear_fc2`` (``local_experts.j.*`` of SequentialMLP or
  ``linear_fc1.weight{j}`` of a grouped MLP); dense layers (``mlp_only_layers``) likewise into
  ``mlp.linear_fc1``/``linear_fc2``;
* ``model.norm`` -> ``decoder.final_layernorm``; ``lm_head`` -> ``output_layer`` (untied).
"""

from __future__ import annotations

from relaymoe.convert_hf.errors import ConvertError
from relaymoe.convert_hf.shards import SafetensorsCheckpoint


def fused_qkv(q, k, v, heads: int, groups: int, head_dim: int):
    """Megatron's ``linear_qkv`` weight from Hugging Face's q/k/v projections: per KV group,
    its ``heads // groups`` query heads, its key head, its value head (rows), in group order."""
    import torch

    hidden = q.shape[-1]
    per = heads // groups
    q = q.reshape(groups, per * head_dim, hidden)
    k = k.reshape(groups, head_dim, hidden)
    v = v.reshape(groups, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * head_dim, hidden)


def split_qkv(w, heads: int, groups: int, head_dim: int):
    """The inverse of ``fused_qkv``: (q, k, v)."""
    per = heads // groups
    w = w.reshape(groups, (per + 2) * head_dim, -1)
    q, k, v = w.split([per * head_dim, head_dim, head_dim], dim=1)
    hidden = w.shape[-1]
    return (
        q.reshape(heads * head_dim, hidden),
        k.reshape(groups * head_dim, hidden),
        v.reshape(groups * head_dim, hidden),
    )


def _expert_weights(hf: SafetensorsCheckpoint, layer: int, expert: int):
    """(fc1 = [gate; up], fc2 = down) of one expert, from the per-expert (Hub) layout or the
    fused one transformers >= 5 keeps in memory (``experts.gate_up_proj``, ``down_proj``)."""
    import torch

    base = f"model.layers.{layer}.mlp.experts"
    if f"{base}.{expert}.gate_proj.weight" in hf:
        gate = hf.get(f"{base}.{expert}.gate_proj.weight")
        up = hf.get(f"{base}.{expert}.up_proj.weight")
        return torch.cat([gate, up], dim=0), hf.get(f"{base}.{expert}.down_proj.weight")
    if f"{base}.gate_up_proj" in hf:
        return hf.get(f"{base}.gate_up_proj")[expert], hf.get(f"{base}.down_proj")[expert]
    raise ConvertError(f"the checkpoint has no weights of expert {expert} in layer {layer}")


def hf_tensor(hf: SafetensorsCheckpoint, name: str, cfg: dict, layer_of: dict, experts_of: dict):
    """The Hugging Face tensor for the Megatron parameter ``name`` (local or TE spec names;
    ``layer_of``: the model's ``decoder.layers.N`` -> global layer; ``experts_of``: global
    layer -> its local expert ids in order)."""
    import torch

    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if name == "embedding.word_embeddings.weight":
        return hf.get("model.embed_tokens.weight")
    if name == "decoder.final_layernorm.weight":
        return hf.get("model.norm.weight")
    if name == "output_layer.weight":
        if "lm_head.weight" in hf:
            return hf.get("lm_head.weight")
        return hf.get("model.embed_tokens.weight")
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        raise ConvertError(f"no Hugging Face tensor maps to Megatron parameter {name!r}")
    local = int(parts[2])
    i = layer_of[local]
    rest = ".".join(parts[3:])
    p = f"model.layers.{i}."
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE spec
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE, dense
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    if rest in simple:
        return hf.get(p + simple[rest])
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = (hf.get(f"{p}self_attn.{x}_proj.weight") for x in "qkv")
        return fused_qkv(q, k, v, heads, groups, head_dim)
    if rest == "mlp.linear_fc1.weight":  # a dense layer
        return torch.cat([hf.get(p + "mlp.gate_proj.weight"), hf.get(p + "mlp.up_proj.weight")])
    for prefix in ("mlp.experts.local_experts.", "mlp.experts.linear_fc"):
        if not rest.startswith(prefix):
            continue
        if prefix.endswith("local_experts."):  # SequentialMLP: local_experts.J.linear_fcN.weight
            j, what = int(parts[6]), parts[7]
        else:  # grouped MLP: linear_fcN.weightJ
            what, j = parts[5], int(parts[6].removeprefix("weight"))
        fc1, fc2 = _expert_weights(hf, i, experts_of[i][j])
        return fc1 if what == "linear_fc1" else fc2
    raise ConvertError(f"no Hugging Face tensor maps to Megatron parameter {name!r}")
