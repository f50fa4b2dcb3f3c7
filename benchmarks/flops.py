"""Model FLOPs of a training step, as megatron-core counts them: the one place that says how many
floating-point operations a token costs (``bench_e2e.py``'s ``model_tflops_per_gpu``).

Re-derived from ``num_floating_point_operations`` in megatron/training/training.py (megatron-core
0.19.2, the plain-GPT branch; MLA and hybrid Mamba models are not modelled here). Per token, with
``h`` the hidden size, ``s`` the sequence length, ``d`` the head dim, ``q = heads * d``, ``kv =
query_groups * d``, ``f = 3`` for a gated MLP (SwiGLU: fc1 has 2I rows) else 2, and every GEMM
counted ``2 * m * n * k`` forward and three times in all (forward, data gradient, weight
gradient)::

    flops_per_token = 6 * (
          h * f * (ffn * dense_layers + (k * moe_ffn + shared_ffn) * moe_layers)   # MLPs
        + attn_layers * (h * (q + 2 * kv + gate) + q * h)                          # projections
        + attn_layers * s * q                                                      # core, causal
        + gdn_layers * (h * (2 * qk + 2 * v + 2 * v_heads) + conv * (2 * qk + v)
                        + 4 * v_heads * v_head_dim**2 + h * v)                     # linear attn
        + mtp * (3 * h + 2 * h * h)                                                # MTP norms/proj
        + h * V_padded * (1 + mtp)                                                 # output layer
    )

- MoE layers count only the ``k`` (top-k) experts a token is routed to, plus shared experts:
  the activated FLOPs, not the 128 experts' weights. The router (``h * E``) is not counted.
- Core attention: ``QK^T`` and ``softmax(QK^T) V`` are ``2 * s * q`` multiply-adds a token each
  over the full square; the causal mask halves them, the multiply-add doubles them back: ``2 *
  s * q`` forward, ``6 * s * q`` in all (Megatron's ``/ 2 * 2``). Sequences are unpacked (BSHD).
- ``gate = q`` with an attention output gate, else 0.
- ``mtp`` multi-token-prediction layers add a transformer layer each (MoE when the last layer
  is), their norms and projection, and one more output layer.
- Recompute is not counted (Megatron's model FLOPs, not hardware FLOPs): a run that recomputes
  the attention core or whole layers does more work than this number says.
- Embedding lookups, norms, activations, softmax and the loss are not counted.
"""

from __future__ import annotations

__all__ = ["flops_per_token", "model_tflops_per_gpu", "shape_flops_per_token"]


def flops_per_token(model, seq_length: int, *, tp: int = 1) -> float:
    """Model FLOPs (forward + backward) of one token of a ``seq_length`` sequence of ``model`` (a
    ``relaymoe.config.ModelConfig``), as megatron-core's ``num_floating_point_operations``
    counts them divided by the batch's tokens; the module docstring states the formula. ``tp``:
    the tensor-parallel size, which pads the vocabulary (``padded_vocab_size``)."""
    m = model
    h, s = m.hidden_size, seq_length
    f = 3 if m.swiglu else 2
    mtp = m.mtp_num_layers or 0
    moe_pattern = list(m.moe_layer_pattern)
    layers = m.num_layers + mtp
    moe_layers = sum(moe_pattern) + moe_pattern[-1] * mtp
    dense_layers = layers - moe_layers
    shared = m.moe_shared_expert_intermediate_size or 0
    mlp = h * f * ((m.ffn_hidden_size or 0) * dense_layers
                   + (m.moe_router_topk * m.moe_ffn_hidden_size + shared) * moe_layers)  # fmt: skip
    if m.experimental_attention_variant is None:
        attn_layers, gdn_layers = layers, 0
    else:  # Megatron's linear_attention_freq pattern over the layers, MTP layers included
        f_la = m.linear_attention_freq
        if isinstance(f_la, tuple):
            if mtp:
                raise ValueError("a linear-attention pattern list with MTP layers: Megatron "
                                 "asks for one entry per layer, MTP included")  # fmt: skip
            gdn_layers = sum(f_la)
        else:
            gdn_layers = sum(0 if (i + 1) % f_la == 0 else 1 for i in range(layers))
        attn_layers = layers - gdn_layers
    d = m.head_dim
    q, kv = m.num_attention_heads * d, m.query_groups * d
    gate = q if m.attention_output_gate else 0
    proj = attn_layers * (h * (q + 2 * kv + gate) + q * h)
    core = attn_layers * s * q
    qk = m.linear_key_head_dim * m.linear_num_key_heads
    v = m.linear_value_head_dim * m.linear_num_value_heads
    gdn = gdn_layers * (
        h * (2 * qk + 2 * v + 2 * m.linear_num_value_heads)
        + m.linear_conv_kernel_dim * (2 * qk + v)
        + 4 * m.linear_num_value_heads * m.linear_value_head_dim**2
        + h * v
    )
    mtp_proj = mtp * (3 * h + 2 * h * h)
    logits = h * m.padded_vocab_size(tp) * (1 + mtp)
    return 6.0 * (mlp + proj + core + gdn + mtp_proj + logits)


def shape_flops_per_token(config: str, seq_length: int | None = None, *, tp: int = 1) -> float:
    """:func:`flops_per_token` of the config named ``config`` (``relaymoe.config.load_config``:
    a name under configs/ or a path) at ``seq_length`` (None: the config's own)."""
    from relaymoe.config import load_config

    cfg = load_config(config)
    return flops_per_token(cfg.model, seq_length or cfg.training.seq_length, tp=tp)


def model_tflops_per_gpu(tokens_per_s: float | None, flops_per_token: float, gpus: int):
    """TFLOP/s per GPU that ``tokens_per_s`` (tokens of the whole job a second) amount to; None
    without a rate."""
    if tokens_per_s is None:
        return None
    return tokens_per_s * flops_per_token / gpus / 1e12
