"""Memory model terms against hand-computed values, monotonicity, routing choice, recompute plan."""

import argparse

import pytest

from relaymoe.config import config_from_dict, load_config
from relaymoe.planner import (
    config_from_megatron_args,
    per_hop_bytes,
    plan,
    plan_from_megatron_args,
    plan_recompute,
    stage_peak,
    usable_bytes,
)
from relaymoe.planner import memory as mm

GiB = 2**30


def small(**over):
    d = {
        "model": {
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "kv_channels": 16,
            "num_experts": 4,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 32,
            "vocab_size": 128,
        },
        "parallel": {"tp": 1, "ep": 1, "sequence_parallel": False},
        "training": {"seq_length": 128, "micro_batch_size": 2},
    }
    for sec, kv in over.items():
        d[sec].update(kv)
    return config_from_dict(d, name="small")


def test_terms_hand_computed():
    cfg = small()
    sh = mm.shapes(cfg)
    assert (sh.T_a, sh.T, sh.P, sh.El, sh.e) == (256, 256, 512, 4, 2)
    assert mm.layer_input_bytes(sh) == 2 * 256 * 64
    # norm+proj inputs 2*2*256*64, q/k/v 2*256*(4+2*2)*16, out 2*256*4*16, lse 4*256*4
    assert mm.attention_keep_bytes(cfg, sh, 0) == 65536 + 65536 + 32768 + 4096
    # norms 2*2*256*64, router 10*256*4, dispatched in + fc1 out + fc2 in 2*512*(64+3*32)
    assert mm.moe_keep_bytes(cfg, sh, 0, "alltoall") == 65536 + 10240 + 163840
    assert mm.moe_keep_bytes(cfg, sh, 0, "ring") == 65536 + 10240 + 12 * 512 + 4 * 512
    # 4 (P,H) buffers, 3 (P,I) intermediates, local expert grads 4*3*64*32*2, router
    assert mm.moe_peak_alltoall(sh) == 262144 + 98304 + 49152 + 10240
    # router, index, out + fp32 dx, one hop (all pairs at R=1) * (2I+2I+I+H) * 2, expert grads
    assert mm.moe_peak_ring(sh, "expert") == 10240 + 6144 + 98304 + 229376 + 49152
    # attention: 64*(64 + 2*2*16) + 64*64 + norm 64; MLP: norm 64 + router 4*64; experts 4*3*64*32
    assert mm.total_params(cfg) == 128 * 64 * 2 + 64 + 2 * (12352 + 320 + 24576)
    st = mm.model_state_bytes(cfg, 0)
    n = mm.total_params(cfg)
    assert st == {"params": 2 * n, "grads": 4 * n, "optimizer": 12 * n}
    assert mm.logits_bytes(cfg, sh) == 6 * 256 * 128
    v = per_hop_bytes(sh)
    assert v["expert"] == {"forward": 49152, "backward": 147456, "total": 196608}
    assert v["token"]["forward"] == 32768 + 4096 + 65536
    assert v["token"]["backward"] == 65536 + 4096 + 65536 + 2048
    # the stage peak is the sum of its terms: states + retained inputs + max(layer ws, logits)
    pk = stage_peak(cfg, 0, "alltoall")
    ws = mm.attention_keep_bytes(cfg, sh, 0) + mm.moe_peak_alltoall(sh)
    assert pk.terms["layer_working_set"] == ws
    assert pk.total == sum(st.values()) + 2 * mm.layer_input_bytes(sh) + max(ws, 327680)


def test_parallel_sharding_terms():
    cfg = small(parallel={"tp": 2, "cp": 2, "dp": 2, "ep": 4, "sequence_parallel": True})
    sh = mm.shapes(cfg)
    assert (sh.T_a, sh.T, sh.El) == (128, 64, 1)  # b*s/cp, /tp with SP
    sp = mm.stage_params(cfg, 0)
    assert sp.expert == 4 * 3 * 64 * 32 * 2 // 4
    st = mm.model_state_bytes(cfg, 0)
    assert st["optimizer"] == 12 * sp.dense // 4 + 12 * sp.expert // 2  # dense/(dp*cp), expert-dp


def test_longer_sequence_needs_more_memory():
    cfg = load_config("qwen3_30b_a3b")
    for d in ("alltoall", "ring"):
        peaks = [stage_peak(cfg, 0, d, seq=s).total for s in (8192, 16384, 32768, 65536)]
        assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_more_memory_fewer_recomputed_layers():
    cfg = load_config("qwen3_30b_a3b").replace(
        training={"seq_length": 131072, "micro_batch_size": 1}
    )
    for d in ("alltoall", "ring"):
        last = None
        counts = []
        for gb in range(30, 120, 1):
            try:
                rp = plan_recompute(cfg, d, usable_bytes(gb * GiB))
            except ValueError:
                continue
            counts.append(len(rp.recomputed_layers))
            if last is not None:
                assert len(rp.recomputed_layers) <= last
            last = len(rp.recomputed_layers)
        assert len(set(counts)) > 2, counts  # the sweep crosses partial plans


def test_ring_moe_peak_below_alltoall_when_k_ge_2():
    for name in ("qwen3_30b_a3b", "qwen2_57b_a14b", "qwen3_5_35b_a3b", "table3/k4", "table3/e384"):
        base = load_config(name)
        for ep in (1, 2, 8):
            for seq, mbs in ((4096, 1), (32768, 2), (65536, 4)):
                cfg = base.replace(
                    parallel={"ep": ep, "dp": max(ep // (base.parallel.tp * base.parallel.cp), 1)},
                    training={
                        "seq_length": seq,
                        "micro_batch_size": mbs,
                        "global_batch_size": None,
                    },
                )
                sh = mm.shapes(cfg)
                from relaymoe.planner import choose_mode

                ring = mm.moe_peak_ring(sh, choose_mode(sh))
                assert ring < mm.moe_peak_alltoall(sh), (name, ep, seq, mbs)


def test_routing_choice_follows_table2():
    cfg = load_config("table3/base_e128_k8_h768")
    assert (
        plan(
            cfg.replace(training={"seq_length": 2048, "micro_batch_size": 1}), "h200-141gb"
        ).routing_mode
        == "token"
    )
    big = cfg.replace(training={"seq_length": 65536, "micro_batch_size": 12})
    sh = mm.shapes(big)
    v = per_hop_bytes(sh)
    assert v["expert"]["total"] < v["token"]["total"]


def test_plan_fields_and_json():
    p = plan(load_config("qwen3_30b_a3b"), "h100-80gb")
    d = p.to_dict()
    for k in (
        "routing_mode",
        "per_hop_bytes",
        "moe_peak_bytes",
        "peak_bytes",
        "recompute_plan",
        "max_seq_length",
        "megatron_args",
    ):
        assert k in d
    assert set(d["max_seq_length"]) == {"alltoall", "ring"}
    assert d["moe_peak_bytes"]["ring"] < d["moe_peak_bytes"]["alltoall"]
    assert "--moe-token-dispatcher-type" in d["megatron_args"]
    assert p.to_json()  # serializable


def test_unfit_raises_clear_error():
    cfg = load_config("qwen2_57b_a14b")
    with pytest.raises(ValueError, match="does not fit with ring even with full recompute"):
        plan(cfg.replace(parallel={"pp": 1, "ep": 1, "dp": 1}), "h100-64gb")


def test_plan_from_megatron_args_matches_config():
    cfg = load_config("qwen3_30b_a3b")
    m, p, t = cfg.model, cfg.parallel, cfg.training
    args = argparse.Namespace(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=32,
        group_query_attention=True,
        num_query_groups=4,
        kv_channels=128,
        num_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
        ffn_hidden_size=6144,
        padded_vocab_size=152064,
        untie_embeddings_and_output_weights=True,
        qk_layernorm=True,
        moe_layer_freq=1,
        tensor_model_parallel_size=p.tp,
        context_parallel_size=p.cp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=1,
        data_parallel_size=1,
        sequence_parallel=True,
        use_distributed_optimizer=True,
        seq_length=t.seq_length,
        micro_batch_size=1,
        global_batch_size=64,
        bf16=True,
        moe_token_dispatcher_type="ring",
        relaymoe_ring_mode="auto",
        rank=0,
    )
    c2 = config_from_megatron_args(args)
    assert mm.total_params(c2) == mm.total_params(
        cfg.replace(model={"vocab_size": 152064, "make_vocab_size_divisible_by": 1})
    )
    a = plan_from_megatron_args(args, gpu_bytes=80 * 10**9)
    b = plan(cfg, 80 * 10**9)
    assert a.megatron_args == b.megatron_args and a.routing_mode == b.routing_mode
    assert set(a.megatron_args) == {
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "recompute_modules",
    }
