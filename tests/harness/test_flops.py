"""``benchmarks/flops.py`` on CPU: the model FLOPs a token costs, against numbers worked out by
hand from the formula and against megatron-core's own ``num_floating_point_operations``."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from benchmarks.flops import flops_per_token, model_tflops_per_gpu, shape_flops_per_token
from relaymoe.config import load_config
from relaymoe.config.schema import ModelConfig


def _dense_one_layer(**kw) -> ModelConfig:
    """One dense layer (moe_layer_freq (0,): no MoE), hidden 64, 4 heads of 16, GELU MLP 256,
    vocabulary 128 (a multiple of 128: no padding)."""
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_experts=2,
                moe_router_topk=1, moe_ffn_hidden_size=32, vocab_size=128, ffn_hidden_size=256,
                moe_layer_freq=(0,), swiglu=False)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def test_a_dense_layer_is_six_flops_a_weight_plus_the_causal_attention():
    """By hand: a token multiplies each GEMM weight once forward (2 FLOPs) and twice backward
    (4): 6 x the matmul weights; the attention core adds 6 x s x q (QK^T and PV over the causal
    half, fwd + bwd)."""
    s = 32
    weights = (
        64 * 256 + 256 * 64  # fc1, fc2 (GELU: one fc1 row block)
        + 64 * (64 + 64 + 64)  # Q, K, V (4 groups = 4 heads)
        + 64 * 64  # attention output projection
        + 64 * 128  # output layer
    )  # fmt: skip
    assert weights == 57344
    expect = 6 * weights + 6 * s * 64
    assert expect == 356352
    assert flops_per_token(_dense_one_layer(), s) == expect


def test_swiglu_gqa_and_the_output_gate_by_hand():
    m = _dense_one_layer(swiglu=True, num_query_groups=2, attention_output_gate=True)
    # SwiGLU: fc1 has 2 x 256 rows; GQA: K and V of 2 groups of 16; gate: another Q-sized block
    weights = 64 * 512 + 256 * 64 + 64 * (64 + 32 + 32 + 64) + 64 * 64 + 64 * 128
    assert flops_per_token(m, 32) == 6 * weights + 6 * 32 * 64


def test_moe_counts_the_top_k_experts_only():
    """An MoE layer costs its k routed experts (and shared ones), whatever the expert count."""
    moe = dict(moe_layer_freq=(1,), swiglu=True, moe_ffn_hidden_size=32)
    a = flops_per_token(_dense_one_layer(**moe, num_experts=8, moe_router_topk=2), 16)
    b = flops_per_token(_dense_one_layer(**moe, num_experts=64, moe_router_topk=2), 16)
    c = flops_per_token(_dense_one_layer(**moe, num_experts=64, moe_router_topk=4), 16)
    assert a == b
    assert c - b == 6 * 2 * (64 * 2 * 32 + 32 * 64)  # two more experts' fc1 (gated) and fc2
    with_shared = _dense_one_layer(**moe, num_experts=64, moe_router_topk=4,
                                   moe_shared_expert_intermediate_size=96)  # fmt: skip
    shared = flops_per_token(with_shared, 16)
    assert shared - c == 6 * (64 * 2 * 96 + 96 * 64)


def test_only_the_attention_core_grows_with_the_sequence():
    """Per token, everything but the attention core is independent of the sequence: a batch's
    FLOPs outside attention scale linearly in its tokens; the core adds 6 x q per token per
    position of the sequence (causal) in every attention layer."""
    cfg = load_config("qwen3_slice")
    m = cfg.model
    q = m.num_attention_heads * m.head_dim
    per_token = {s: flops_per_token(m, s) for s in (1024, 4096, 16384)}
    no_core = {s: f - 6 * q * m.num_layers * s for s, f in per_token.items()}
    assert no_core[1024] == no_core[4096] == no_core[16384] > 0
    assert per_token[16384] - per_token[4096] == 6 * q * m.num_layers * (16384 - 4096)


def test_qwen3_slice_is_about_two_gflop_a_token():
    """The issue's "about 2.2 GFLOP a token, fwd+bwd, activated experts only", term by term."""
    h, s, L, V = 2048, 4096, 4, 32768
    moe = 6 * h * 3 * 8 * 768 * L
    proj = 6 * L * (h * (4096 + 2 * 512) + 4096 * h)
    core = 6 * L * s * 4096
    logits = 6 * h * V
    assert shape_flops_per_token("qwen3_slice", 4096) == moe + proj + core + logits
    assert shape_flops_per_token("qwen3_slice", 4096) == pytest.approx(2.164e9, rel=1e-3)
    # 48k tokens/s on one GPU (the eager ring at global batch 16): ~105 TFLOP/s
    assert model_tflops_per_gpu(48_000, moe + proj + core + logits, 1) == pytest.approx(104, 0.01)
    assert model_tflops_per_gpu(None, 1.0, 1) is None


def _megatron_args(m: ModelConfig, seq: int, tp: int = 1) -> SimpleNamespace:
    """The arguments megatron-core's FLOP count reads, as its parser would make them."""
    gqa = m.query_groups != m.num_attention_heads
    return SimpleNamespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, seq_length=seq,
        num_attention_heads=m.num_attention_heads, group_query_attention=gqa,
        num_query_groups=m.query_groups if gqa else None, kv_channels=m.head_dim,
        num_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
        moe_layer_freq=list(m.moe_layer_pattern), moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size, moe_latent_size=None,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        swiglu=m.swiglu, multi_latent_attention=False,
        attention_output_gate=m.attention_output_gate, mtp_num_layers=m.mtp_num_layers,
        experimental_attention_variant=m.experimental_attention_variant,
        linear_attention_freq=(list(m.linear_attention_freq)
                               if isinstance(m.linear_attention_freq, tuple)
                               else m.linear_attention_freq),
        linear_key_head_dim=m.linear_key_head_dim, linear_value_head_dim=m.linear_value_head_dim,
        linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim,
        padded_vocab_size=m.padded_vocab_size(tp), hybrid_layer_pattern=None,
    )  # fmt: skip


@pytest.mark.parametrize(
    "config", ["qwen3_slice", "qwen3_slice_v152k", "tiny_qwen3_gelu", "qwen3_30b_a3b",
               "qwen3_5_35b_a3b", "qwen2_57b_a14b"],
)  # fmt: skip
@pytest.mark.parametrize("seq", [4096, 16384])
def test_megatron_counts_the_same(config, seq):
    """megatron-core 0.19's ``num_floating_point_operations`` over a batch of 3 sequences, per
    token, equals ours (re-derived, not called) for every shipped config family: MoE with and
    without shared experts, GELU, GQA, gated delta net layers, MTP where the config has it."""
    training = pytest.importorskip("megatron.training.training")
    m = load_config(config).model
    args = _megatron_args(m, seq)
    theirs = training.num_floating_point_operations(args, 3) / (3 * seq)
    assert flops_per_token(m, seq) == pytest.approx(theirs, rel=1e-12)
    if m.mtp_num_layers is None:  # the same with one MTP layer (a copy, Megatron's counting)
        m2 = dataclasses.replace(m, mtp_num_layers=1)
        args2 = _megatron_args(m2, seq)
        ours = flops_per_token(m2, seq)
        assert ours == pytest.approx(
            training.num_floating_point_operations(args2, 3) / (3 * seq), rel=1e-12
        )
