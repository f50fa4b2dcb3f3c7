"""An O(s)-memory core attention for Megatron runs without TransformerEngine (benchmarks only).

Without TransformerEngine megatron-core builds its local ``DotProductAttention``, which
materialises a layer's (heads, s, s) scores and keeps the softmax for the backward: at long
sequences it runs out of memory long before the MoE block or the loss would, whereas a user on
a real cluster has TE's flash attention. ``SdpaCoreAttention`` is a drop-in replacement (same
constructor and forward signature) built on ``torch.nn.functional.scaled_dot_product_attention``
restricted to the flash backend: it keeps q, k, v, the output and the per-row log-sum-exp, like
TE's flash attention, and never an (s, s) tensor.

Megatron picks it up through its own ``--spec`` flag (no patch of Megatron or relaymoe):

    --spec benchmarks.sdpa_attention sdpa_decoder_spec --no-create-attention-mask-in-dataloader

``sdpa_decoder_spec`` returns the decoder spec Megatron would build by default, with every
layer's local core attention replaced, and prints ``MARKER`` so that a harness can check from
the log that the substitution happened (Megatron's ``--spec`` import falls back to the default
spec, silently, when the import fails). The dataloader's attention mask is (b, 1, s, s): the
flag turns it off, and this attention refuses a mask (it is causal by construction).

Shapes (Megatron's layout): ``q_SBNd`` (sequence, batch, heads per TP rank, head dim),
``k_SBGd`` / ``v_SBGd`` (G query groups per TP rank), output ``(S, B, N*d)``.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention import SDPBackend, sdpa_kernel

MARKER = "[sdpa_attention] core attention replaced by SdpaCoreAttention"
# Flash only: its memory is O(s) and known (q/k/v/out/lse kept; see the planner's
# attention_keep_bytes). The math backend would silently bring back the (s, s) scores.
BACKENDS = (SDPBackend.FLASH_ATTENTION,)


class SdpaCoreAttention(MegatronModule):
    """Causal (GQA) attention through SDPA's flash backend, Megatron's core-attention interface.

    Refused when built (``ValueError`` naming the setting): context parallelism, a non-causal
    mask type, attention dropout, a softmax variant other than ``vanilla``, sliding windows.
    Refused in ``forward``: an explicit attention mask, an attention bias, packed sequences.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if config.context_parallel_size != 1:
            raise ValueError(
                f"SdpaCoreAttention: context_parallel_size={config.context_parallel_size}; it "
                "supports 1 only (no ring attention); drop --context-parallel-size"
            )
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(
                f"SdpaCoreAttention: attn_mask_type={attn_mask_type}; only causal self-attention "
                "is supported; use megatron-core's DotProductAttention for other masks"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"SdpaCoreAttention: attention dropout {dropout}; only 0 is supported (Megatron's "
                "RNG tracker would not drive SDPA's dropout); pass --attention-dropout 0"
            )
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type != "vanilla":
            raise ValueError(
                f"SdpaCoreAttention: softmax_type={softmax_type!r}; only 'vanilla' is supported"
            )
        if getattr(config, "window_size", None) is not None:
            raise ValueError(
                f"SdpaCoreAttention: window_size={config.window_size}; sliding-window attention "
                "is not supported; unset --window-size"
            )
        if pg_collection is not None:
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size()
        for name, n in (("num_attention_heads", config.num_attention_heads),
                        ("num_query_groups", config.num_query_groups)):  # fmt: skip
            if n % tp:
                raise ValueError(
                    f"SdpaCoreAttention: {name}={n} is not divisible by the tensor-parallel "
                    f"size {tp}; pick a tensor-parallel size that divides it"
                )
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        # Megatron's local attention divides the scale by the layer number when
        # apply_query_key_layer_scaling is set and multiplies it back in the softmax: the net
        # scale is 1/sqrt(d) (or the given one) either way.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``query (S, B, N, d)``, ``key``/``value (S, B, G, d)`` -> ``(S, B, N*d)``."""
        if attention_mask is not None:
            raise ValueError(
                f"SdpaCoreAttention got an attention mask of shape {tuple(attention_mask.shape)}; "
                "it is causal by construction and a (b, 1, s, s) mask defeats its O(s) memory: "
                "pass --no-create-attention-mask-in-dataloader"
            )
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SdpaCoreAttention: attn_mask_type={attn_mask_type}; causal only")
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "SdpaCoreAttention: attention_bias and packed sequences are not supported"
            )
        s, b, n, d = query.shape
        if n != self.heads or key.shape[2] != self.groups or d != self.head_dim:
            raise ValueError(
                f"SdpaCoreAttention: query {tuple(query.shape)}, key {tuple(key.shape)}; "
                f"expected {self.heads} heads and {self.groups} groups of dim {self.head_dim}"
            )
        # (S, B, H, d) -> (B, H, S, d) views: flash needs only a unit stride in d
        q_BNSd, k_BGSd, v_BGSd = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        try:
            with sdpa_kernel(list(BACKENDS)):
                o_BNSd = F.scaled_dot_product_attention(
                    q_BNSd,
                    k_BGSd,
                    v_BGSd,
                    is_causal=True,
                    scale=self.softmax_scale,
                    enable_gqa=self.heads != self.groups,
                )
        except torch.cuda.OutOfMemoryError:
            raise  # an OOM is an OOM (the max-seq harness reads it from the log)
        except RuntimeError as e:
            raise RuntimeError(
                f"SdpaCoreAttention: SDPA's flash backend refused q {tuple(q_BNSd.shape)} "
                f"{q_BNSd.dtype} on {q_BNSd.device} ({e}); it needs fp16/bf16 on CUDA (sm80+) "
                "and a head dim <= 256"
            ) from e
        return o_BNSd.permute(2, 0, 1, 3).reshape(s, b, n * d)


def substitute_core_attention(spec):
    """A copy of a GPT layer or block spec whose local core attention is ``SdpaCoreAttention``.

    Accepts a ``ModuleSpec`` of one layer or a ``TransformerBlockSubmodules`` (``layer_specs``).
    Returns ``(new_spec, replaced)``. Raises ``ValueError`` when a layer's core attention is
    not megatron-core's local ``DotProductAttention`` (e.g. TransformerEngine's, which needs
    no substitute) or when no layer has self-attention to replace.
    """
    spec = copy.deepcopy(spec)
    layers = getattr(spec, "layer_specs", None)
    layers = [spec] if layers is None else list(layers)
    replaced = 0
    for layer in layers:
        attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
        sub = getattr(attn, "submodules", None)
        core = getattr(sub, "core_attention", None)
        if core is None:
            continue
        if core is SdpaCoreAttention:
            replaced += 1
            continue
        if core is not DotProductAttention:
            raise ValueError(
                f"layer spec core attention is {getattr(core, '__name__', core)!r}, not "
                "megatron-core's local DotProductAttention; SdpaCoreAttention only replaces the "
                "local one (with TransformerEngine installed, drop --spec and use its attention)"
            )
        sub.core_attention = SdpaCoreAttention
        replaced += 1
    if not replaced:
        raise ValueError(
            f"no self-attention core found in the spec ({type(spec).__name__}); nothing to "
            "replace with SdpaCoreAttention"
        )
    return spec, replaced


def sdpa_decoder_spec(config, vp_stage: int | None = None):
    """``--spec benchmarks.sdpa_attention sdpa_decoder_spec``: Megatron's default decoder spec
    for ``config`` (a ``GPTModelConfig``) with ``SdpaCoreAttention`` in every layer."""
    from megatron.training.models.gpt import default_layer_spec

    spec, replaced = substitute_core_attention(default_layer_spec(config, vp_stage))
    print(f"{MARKER} in {replaced} layer spec(s) (SDPA backends: "
          f"{', '.join(b.name for b in BACKENDS)})", flush=True)  # fmt: skip
    return spec


__all__ = ["BACKENDS", "MARKER", "SdpaCoreAttention", "sdpa_decoder_spec",
           "substitute_core_attention"]  # fmt: skip
