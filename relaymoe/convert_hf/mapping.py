"""Which Hugging Face tensor of a Qwen3-MoE model is which Megatron tensor, in both directions.

One table for ``relaymoe convert-hf`` (Hugging Face -> Megatron parameters) and ``relaymoe
export-hf`` (a Megatron checkpoint's keys -> Hugging Face tensors):

* ``model.embed_tokens.weight`` <-> ``embedding.word_embeddings.weight``; ``model.norm`` <->
  ``decoder.final_layernorm``; ``lm_head`` <-> ``output_layer`` (untied only: a tied model has no
  ``lm_head`` tensor, its output layer is the embedding);
* q/k/v_proj <-> ``self_attention.linear_qkv.weight``, interleaved per query group: for each KV
  group its query heads, then its key head, then its value head (so that a TP split along
  dim 0 gives each rank whole groups): ``fused_qkv`` and its inverse ``split_qkv``;
* q_norm/k_norm <-> ``self_attention.q_layernorm`` / ``k_layernorm``; o_proj <-> ``linear_proj``;
* input_layernorm <-> ``input_layernorm`` (the local spec's parameter) or
  ``self_attention.linear_qkv.layer_norm_weight`` (the key both specs save it under, TE's fused
  name); post_attention_layernorm <-> ``pre_mlp_layernorm`` or ``mlp.linear_fc1.layer_norm_weight``
  (the TE spec keys it ``pre_mlp_layernorm`` in MoE layers, the local spec
  ``mlp.linear_fc1.layer_norm_weight`` everywhere: ``relaymoe.megatron.checkpoint_compat``);
* ``mlp.gate`` <-> ``mlp.router``; expert ``j``'s [gate_proj; up_proj] <-> ``linear_fc1`` (gate rows
  first, SwiGLU's order: ``fused_gate_up``), down_proj <-> ``linear_fc2``. In the model these are
  ``local_experts.j.*`` (SequentialMLP) or ``linear_fc1.weight{j}`` (a grouped MLP); in a
  ``torch_dist`` checkpoint every expert layout saves one key, ``mlp.experts.experts.linear_fc1
  .weight``, with the global expert id as its first axis. Dense layers (``mlp_only_layers``)
  likewise into ``mlp.linear_fc1``/``linear_fc2``.
"""

from __future__ import annotations

from relaymoe.convert_hf.errors import ConvertError
from relaymoe.convert_hf.hf_config import moe_layer_pattern
from relaymoe.convert_hf.shards import SafetensorsCheckpoint

# Megatron name outside the decoder layers -> Hugging Face name
GLOBAL_TENSORS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# Megatron name inside ``decoder.layers.N.`` -> Hugging Face name inside ``model.layers.N.``, the
# tensor as it is; two Megatron names stand for each norm (the layer specs key them differently)
LAYER_TENSORS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
QKV = "self_attention.linear_qkv.weight"  # q/k/v_proj, interleaved per query group
DENSE_FC1 = "mlp.linear_fc1.weight"  # a dense layer's [gate_proj; up_proj]
# the checkpoint keys of a MoE layer's experts: global expert id first, then fc1 [gate; up] or fc2
EXPERTS_FC1 = "mlp.experts.experts.linear_fc1.weight"
EXPERTS_FC2 = "mlp.experts.experts.linear_fc2.weight"


def hf_layer(layer: int) -> str:
    """The prefix of decoder layer ``layer``'s Hugging Face tensors."""
    return f"model.layers.{layer}."


def hf_qkv_names(layer: int) -> tuple[str, str, str]:
    p = hf_layer(layer)
    return tuple(f"{p}self_attn.{x}_proj.weight" for x in "qkv")


def hf_dense_mlp_names(layer: int) -> tuple[str, str, str]:
    """(gate_proj, up_proj, down_proj) of a dense layer."""
    p = hf_layer(layer)
    return tuple(f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down"))


def hf_expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """(gate_proj, up_proj, down_proj) of one expert, as the Hub's checkpoints name them."""
    p = f"{hf_layer(layer)}mlp.experts.{expert}."
    return tuple(f"{p}{x}_proj.weight" for x in ("gate", "up", "down"))


def hf_names(cfg: dict) -> list[str]:
    """Every tensor of a Hugging Face Qwen3-MoE checkpoint of ``config.json`` ``cfg``, in order:
    the embedding, each layer's, the final norm, the output layer (untied only)."""
    names = [GLOBAL_TENSORS["embedding.word_embeddings.weight"]]
    for i, sparse in enumerate(moe_layer_pattern(cfg)):
        p = hf_layer(i)
        names += [p + "input_layernorm.weight", *hf_qkv_names(i), p + "self_attn.q_norm.weight",
                  p + "self_attn.k_norm.weight", p + "self_attn.o_proj.weight",
                  p + "post_attention_layernorm.weight"]  # fmt: skip
        if sparse:
            names.append(p + "mlp.gate.weight")
            for j in range(cfg["num_experts"]):
                names += hf_expert_names(i, j)
        else:
            names += hf_dense_mlp_names(i)
    names.append(GLOBAL_TENSORS["decoder.final_layernorm.weight"])
    if not cfg.get("tie_word_embeddings", False):
        names.append(GLOBAL_TENSORS["output_layer.weight"])
    return names


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
    """The inverse of ``fused_qkv``: (q, k, v), each contiguous."""
    per = heads // groups
    w = w.reshape(groups, (per + 2) * head_dim, -1)
    q, k, v = w.split([per * head_dim, head_dim, head_dim], dim=1)
    hidden = w.shape[-1]
    return (
        q.reshape(heads * head_dim, hidden).contiguous(),
        k.reshape(groups * head_dim, hidden).contiguous(),
        v.reshape(groups * head_dim, hidden).contiguous(),
    )


def fused_gate_up(gate, up):
    """Megatron's SwiGLU ``linear_fc1`` from gate_proj and up_proj: the gate's rows first."""
    import torch

    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1):
    """The inverse of ``fused_gate_up``: (gate_proj, up_proj), each contiguous."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def attention_shape(cfg: dict) -> tuple[int, int, int]:
    """(query heads, KV groups, head dim) of a Qwen3-MoE ``config.json``."""
    heads = cfg["num_attention_heads"]
    return heads, cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or (
        cfg["hidden_size"] // heads)  # fmt: skip


def _expert_weights(hf: SafetensorsCheckpoint, layer: int, expert: int):
    """(fc1 = [gate; up], fc2 = down) of one expert, from the per-expert (Hub) layout or the
    fused one transformers >= 5 keeps in memory (``experts.gate_up_proj``, ``down_proj``)."""
    gate, up, down = hf_expert_names(layer, expert)
    if gate in hf:
        return fused_gate_up(hf.get(gate), hf.get(up)), hf.get(down)
    base = f"{hf_layer(layer)}mlp.experts"
    if f"{base}.gate_up_proj" in hf:
        return hf.get(f"{base}.gate_up_proj")[expert], hf.get(f"{base}.down_proj")[expert]
    raise ConvertError(f"the checkpoint has no weights of expert {expert} in layer {layer}")


def hf_tensor(hf: SafetensorsCheckpoint, name: str, cfg: dict, layer_of: dict, experts_of: dict):
    """The Hugging Face tensor for the Megatron parameter ``name`` (local or TE spec names;
    ``layer_of``: the model's ``decoder.layers.N`` -> global layer; ``experts_of``: global
    layer -> its local expert ids in order)."""
    if name in GLOBAL_TENSORS:
        if name == "output_layer.weight" and GLOBAL_TENSORS[name] not in hf:  # tied
            return hf.get(GLOBAL_TENSORS["embedding.word_embeddings.weight"])
        return hf.get(GLOBAL_TENSORS[name])
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        raise ConvertError(f"no Hugging Face tensor maps to Megatron parameter {name!r}")
    i = layer_of[int(parts[2])]
    rest = ".".join(parts[3:])
    if rest in LAYER_TENSORS:
        return hf.get(hf_layer(i) + LAYER_TENSORS[rest])
    if rest == QKV:
        q, k, v = (hf.get(n) for n in hf_qkv_names(i))
        return fused_qkv(q, k, v, *attention_shape(cfg))
    if rest == DENSE_FC1:
        gate, up, _ = hf_dense_mlp_names(i)
        return fused_gate_up(hf.get(gate), hf.get(up))
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
