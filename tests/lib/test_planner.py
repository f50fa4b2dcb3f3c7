"""Memory model terms against hand-computed values, monotonicity, routing choice, recompute plan."""

import argparse

import pytest

from relaymoe import cost, lossmodel, options
from relaymoe.config import load_config, to_megatron_args
from relaymoe.options import KernelOptions
from relaymoe.planner import (
    VARIANTS,
    config_from_megatron_args,
    parse_gpu,
    per_hop_bytes,
    plan,
    plan_from_megatron_args,
    plan_recompute,
    ring_mode,
    stage_peak,
    usable_bytes,
)
from relaymoe.planner import memory as mm
from relaymoe.planner.plan import seq_quantum
from tests.fixtures import small_config, small_megatron_args

GiB = 2**30


def test_terms_hand_computed():
    cfg = small_config()
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
    # router, index, out + dx (both in the activations' dtype, as the engine allocates them:
    # 2*256*64*2, no longer an fp32 dx), one hop (all pairs at R=1) * (2I+2I+I+H) * 2; no
    # expert weight gradients under gradient-accumulation fusion (Megatron's default: the
    # weight-gradient kernel adds into main_grad), 4*3*64*32*2 without it
    assert sh.wgrad_fusion
    assert mm.moe_peak_ring(sh, "expert") == 10240 + 6144 + 65536 + 229376
    unfused = mm.shapes(small_config(training={"gradient_accumulation_fusion": False}))
    assert mm.moe_peak_ring(unfused, "expert") == 10240 + 6144 + 65536 + 229376 + 49152
    # attention: 64*(64 + 2*2*16) + 64*64 + norm 64; MLP: norm 64 + router 4*64; experts 4*3*64*32
    assert mm.total_params(cfg) == 128 * 64 * 2 + 64 + 2 * (12352 + 320 + 24576)
    st = mm.model_state_bytes(cfg, 0)
    n = mm.total_params(cfg)
    assert st == {"params": 2 * n, "grads": 4 * n, "optimizer": 12 * n}
    assert mm.logits_bytes(cfg, sh) == 6 * 256 * 128
    # the engine sends every accumulator in the activations' dtype (bf16 here), not fp32:
    # expert backward = weights + weight gradients 2*4*3*64*32*2; token forward = x + metadata
    # 256*2*(4+4) + output 2*256*64; backward = x, dy + fp32 probs 256*2*4 (no ids: the forward
    # kept the routing indices) + dx + fp32 dprobs 256*2*4
    v = per_hop_bytes(sh)
    assert v["expert"] == {"forward": 49152, "backward": 98304, "total": 147456}
    assert v["token"]["forward"] == 32768 + 4096 + 32768
    assert v["token"]["backward"] == 65536 + 2048 + 32768 + 2048
    assert mm.final_norm_bytes(cfg, sh) == 2 * 2 * 256 * 64
    # flash backward: dq, dk, dv 2*256*(4+2*2)*16 and the fp32 dq accumulator 4*256*4*16
    assert mm.attention_backward_transient_bytes(cfg, sh, 0) == 65536 + 65536
    # full recompute: states + 2 layer inputs + the last layer's backward (attention 167936,
    # pre-MLP norm 65536 and max(moe peak, inner keep) = 419840, minus the input it holds)
    pk = stage_peak(cfg, 0, "alltoall")
    ws = 167936 + 65536 + 419840 - 32768
    assert pk.terms["layer_working_set"] == ws
    assert pk.terms["logits_loss"] == 196608 + 65536
    assert pk.total == sum(st.values()) + 2 * 32768 + max(ws, 196608 + 65536)
    # nothing recomputed: both layers retained (attention + norm + inner keep 174080); the
    # last layer's backward adds only the rest of the MoE peak (419840 - 174080), not a whole
    # layer again; the loss phase (final norm + logits) is larger here
    pk = stage_peak(cfg, 0, "alltoall", frozenset({0, 1}))
    assert pk.terms["activations_retained"] == 2 * (167936 + 65536 + 174080)
    assert pk.terms["layer_working_set"] == 419840 - 174080
    assert pk.total == sum(st.values()) + 2 * 407552 + 262144
    # block: layer 0 recomputed, layer 1 kept. Layer 1's backward: both retained + its MoE
    # rest; layer 0's: its input + rematerialised layer (layer 1 is done by then)
    pk = stage_peak(cfg, 0, "alltoall", frozenset({1}))
    retained = 32768 + 407552
    assert pk.terms["activations_retained"] == retained
    assert pk.terms["layer_working_set"] == max(245760, 32768 + ws - retained)


def test_expert_mlp_terms_hand_computed():
    """A non-gated expert MLP with biases (``model.swiglu=False``, ``disable_bias_linear=False``,
    as Megatron's ``--swiglu`` / ``--add-bias-linear`` give them): fc1 has I rows, the biases
    travel with the weights, the time model and the mode choice see both."""
    cfg = small_config(model={"swiglu": False, "disable_bias_linear": False})
    sh = mm.shapes(cfg)
    assert (sh.gated, sh.bias, sh.J) == (False, True, 32)
    # experts: 4 * (fc1 32*64 + fc2 64*32 + biases 32 + 64)
    assert mm.moe_params(cfg, 0)[1] == 4 * (2 * 32 * 64 + 96)
    assert per_hop_bytes(sh)["expert"]["forward"] == 4 * (2 * 32 * 64 + 96) * 2
    # dispatched in + fc1 out (P, I) + fc2 in: 2*512*(64+32+32)
    assert mm.moe_keep_bytes(cfg, sh, 0, "alltoall") == 65536 + 10240 + 2 * 512 * 128
    d = sh.dims()
    assert (d.gated, d.b13, d.b2) == (False, True, True)
    args = small_megatron_args(swiglu=False, add_bias_linear=True)
    m = config_from_megatron_args(args).model
    assert (m.swiglu, m.disable_bias_linear) == (False, False)
    m = config_from_megatron_args(small_megatron_args()).model
    assert (m.swiglu, m.disable_bias_linear) == (True, True)


def test_torch_norm_terms_hand_computed():
    fused = small_config()
    torch_ = small_config(training={"normalization_impl": "torch_composite"})
    sh = mm.shapes(fused)
    # torch's fused RMSNorm kernel keeps what the fused model counts: nothing extra
    fused_kernel = small_config(training={"normalization_impl": "torch"})
    for part in ("attention", "mlp", "final"):
        assert mm.norm_extra_bytes(fused_kernel, sh, part) == 0
    assert stage_peak(fused_kernel, 0, "ring").total == stage_peak(fused, 0, "ring").total
    # T = 256 normalised rows of h = 64 per norm, 8 extra bytes per element
    assert mm.norm_extra_bytes(fused, sh, "attention") == 0
    assert mm.norm_extra_bytes(torch_, sh, "attention") == 8 * 256 * 64
    assert mm.norm_extra_bytes(torch_, sh, "mlp") == 8 * 256 * 64
    assert mm.norm_extra_bytes(torch_, sh, "final") == 8 * 256 * 64
    with pytest.raises(ValueError, match="norm part 'x'"):
        mm.norm_extra_bytes(torch_, sh, "x")
    # q/k norms: 256 tokens x (4 heads + 2 groups) x 16
    qk = small_config(
        model={"qk_layernorm": True}, training={"normalization_impl": "torch_composite"}
    )
    assert mm.norm_extra_bytes(qk, sh, "attention") == 8 * (256 * 64 + 256 * 6 * 16)
    assert mm.attention_keep_bytes(torch_, sh, 0) == 167936 + 8 * 256 * 64
    assert mm.moe_keep_bytes(torch_, sh, 0, "alltoall") == 65536 + 8 * 256 * 64 + 174080
    assert mm.moe_keep_bytes(torch_, sh, 0, "ring") == 65536 + 8 * 256 * 64 + 10240 + 8192
    assert mm.final_norm_bytes(torch_, sh) == 65536 + 8 * 256 * 64
    # torch's LayerNorm is one native kernel (input, mean, rstd): nothing extra
    ln = small_config(
        model={"normalization": "LayerNorm"}, training={"normalization_impl": "torch_composite"}
    )
    assert mm.norm_extra_bytes(ln, sh, "attention") == 0
    # no recompute: each layer retains 3 * 8 * T * h more, the loss phase 8 * T * h more
    a = stage_peak(fused, 0, "alltoall", frozenset({0, 1}))
    b = stage_peak(torch_, 0, "alltoall", frozenset({0, 1}))
    x = 8 * 256 * 64
    assert b.terms["activations_retained"] - a.terms["activations_retained"] == 2 * 2 * x
    assert b.terms["logits_loss"] - a.terms["logits_loss"] == x
    assert b.total - a.total == 5 * x
    # full recompute: the rematerialised layer carries both of its norms' extra
    a, b = stage_peak(fused, 0, "alltoall"), stage_peak(torch_, 0, "alltoall")
    assert b.terms["layer_working_set"] - a.terms["layer_working_set"] == 2 * x


def test_torch_norm_monotone_and_ring_still_below():
    cfg = load_config("qwen3_30b_a3b").replace(parallel={"tp": 1, "dp": 2})
    t = cfg.replace(training={"normalization_impl": "torch_composite"})
    for d in ("alltoall", "ring"):
        peaks = [stage_peak(t, 0, d, seq=s).total for s in (8192, 16384, 32768)]
        assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
        for s in (8192, 32768):
            assert stage_peak(t, 0, d, seq=s).total > stage_peak(cfg, 0, d, seq=s).total
        assert plan(t, "h200-141gb").max_seq_length[d] <= plan(cfg, "h200-141gb").max_seq_length[d]
    p = plan(t, "h200-141gb")
    assert p.moe_peak_bytes["ring"] < p.moe_peak_bytes["alltoall"]
    for disp in ("alltoall", "ring"):
        assert p.peak_bytes[disp] <= p.usable_bytes


def test_parallel_sharding_terms():
    cfg = small_config(parallel={"tp": 2, "cp": 2, "dp": 2, "ep": 4, "sequence_parallel": True})
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
                ring = mm.moe_peak_ring(sh, ring_mode(cfg))
                assert ring < mm.moe_peak_alltoall(sh), (name, ep, seq, mbs)


def _cost_kw(sh) -> dict:
    return dict(tokens=sh.T, hidden=sh.h, ffn=sh.I, num_local_experts=sh.El, topk=sh.K,
                world=sh.R, act_bytes=sh.e, prob_bytes=4)  # fmt: skip


def test_routing_choice_follows_the_cost_model():
    cfg = load_config("table3/base_e128_k8_h768")
    short = cfg.replace(training={"seq_length": 2048, "micro_batch_size": 1})
    kw = _cost_kw(mm.shapes(short))
    # the plan runs, sizes memory for and pins the cost model's choice (what mode="auto" runs)
    p = plan(short, "h200-141gb")
    assert p.routing_mode == cost.choose_mode(**kw) == ring_mode(short)
    assert p.moe_peak_bytes["ring"] == p.moe_peak_bytes[f"ring_{p.routing_mode}"]
    # the flags are the config's (one source of truth with `relaymoe flags`): its mode "auto",
    # which the runtime resolves with the same cost model
    assert "--relaymoe-mode auto" in " ".join(p.megatron_flags)
    assert list(p.megatron_flags) == to_megatron_args(short)
    # between the two ring modes, Table 2: tokens travel at short sequences, experts at long
    assert cost.choose_mode(**kw, modes=options.RING_MODES) == "token"
    big = cfg.replace(training={"seq_length": 65536, "micro_batch_size": 12})
    sh = mm.shapes(big)
    v = per_hop_bytes(sh)
    assert v["expert"]["total"] < v["token"]["total"]
    assert cost.choose_mode(**_cost_kw(sh), modes=options.RING_MODES) == "expert"


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
    for k in ("max_seq_length", "max_micro_batch_size", "peak_bytes", "breakdown"):
        assert (
            set(d[k])
            == set(VARIANTS)
            == {
                "alltoall",
                "ring",
                "alltoall_fused_loss",
                "ring_fused_loss",
            }
        )
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
        num_attention_heads=m.num_attention_heads,
        group_query_attention=m.num_query_groups < m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        num_experts=m.num_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        padded_vocab_size=152064,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        qk_layernorm=m.qk_layernorm,
        moe_layer_freq=m.moe_layer_freq,
        tensor_model_parallel_size=p.tp,
        context_parallel_size=p.cp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp,
        data_parallel_size=p.dp,
        sequence_parallel=p.sequence_parallel,
        use_distributed_optimizer=p.use_distributed_optimizer,
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        bf16=t.precision == "bf16",
        moe_token_dispatcher_type="ring",
        relaymoe_mode="auto",
        rank=0,
    )
    c2 = config_from_megatron_args(args)
    assert c2.training.normalization_impl == "fused"  # TransformerEngine, Megatron's default
    assert mm.total_params(c2) == mm.total_params(
        cfg.replace(model={"vocab_size": 152064, "make_vocab_size_divisible_by": 1})
    )
    a = plan_from_megatron_args(args, gpu_bytes=80 * 10**9)
    b = plan(cfg, 80 * 10**9)
    assert a.megatron_args == b.megatron_args and a.routing_mode == b.routing_mode
    # the hop slice budget: the flag, else the run's kernel options, else the default
    assert c2.relaymoe.hop_slice_mib == KernelOptions().hop_slice_mib
    run = KernelOptions(hop_slice_mib=1024)
    assert config_from_megatron_args(args, run).relaymoe.hop_slice_mib == 1024
    flagged = argparse.Namespace(**{**vars(args), "relaymoe_hop_slice_mib": 0})
    assert config_from_megatron_args(flagged, run).relaymoe.hop_slice_mib == 0
    small = plan_from_megatron_args(args, gpu_bytes=80 * 10**9, kernels=run)
    want = plan(cfg.replace(relaymoe={"hop_slice_mib": 1024}), 80 * 10**9)
    assert small.max_seq_length == want.max_seq_length != b.max_seq_length
    assert set(a.megatron_args) == {
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "recompute_modules",
    }


def test_normalization_impl_inferred_from_megatron_args(monkeypatch):
    import importlib

    plan_mod = importlib.import_module("relaymoe.planner.plan")  # the package exports plan()
    args = small_megatron_args(transformer_impl="local")
    real = plan_mod.importlib.util.find_spec
    have_apex = {"v": False}

    def find_spec(name, *a, **k):
        if name == "apex":
            return object() if have_apex["v"] else None
        return real(name, *a, **k)

    monkeypatch.setattr(plan_mod.importlib.util, "find_spec", find_spec)
    assert config_from_megatron_args(args).training.normalization_impl == "torch"
    # a torch without the fused RMSNorm kernel: the composite's fp32 copies are charged
    import types

    old_torch = types.SimpleNamespace(ops=types.SimpleNamespace(aten=types.SimpleNamespace()))
    monkeypatch.setitem(plan_mod.sys.modules, "torch", old_torch)
    assert config_from_megatron_args(args).training.normalization_impl == "torch_composite"
    monkeypatch.undo()
    monkeypatch.setattr(plan_mod.importlib.util, "find_spec", find_spec)
    have_apex["v"] = True  # local spec with apex: FusedLayerNorm
    assert config_from_megatron_args(args).training.normalization_impl == "fused"
    have_apex["v"] = False
    args.transformer_impl = "transformer_engine"
    assert config_from_megatron_args(args).training.normalization_impl == "fused"
    # the torch fallback refuses sequence parallelism, which MoE needs at tp > 1
    args.transformer_impl = "local"
    args.tensor_model_parallel_size, args.sequence_parallel, args.world_size = 2, True, 2
    with pytest.raises(ValueError, match="normalization_impl='torch' with parallel.tp=2"):
        config_from_megatron_args(args)


# -- the fused loss (relaymoe.linear_cross_entropy; bytes from relaymoe.lossmodel) ---------------


def test_fused_loss_term_is_lossmodels():
    cfg = small_config()
    sh = mm.shapes(cfg)
    # T_a = 256 tokens, h = 64, V/tp = 128, bf16: the op's own model, nothing restated here
    # under Megatron's DDP the loss adds its weight gradient into main_grad (accumulate mode),
    # on CUDA through the Triton row kernels (2 bytes a bf16 logit)
    assert mm.FUSED_LOSS_IMPL == "triton"
    fl = lossmodel.fused_loss_bytes(256, 64, 128, act_bytes=2, wgrad="accumulate", impl="triton")
    assert fl.chunk == 256 * 128 * 2
    assert mm.fused_loss_bytes(cfg, sh) == fl.peak
    assert mm.loss_bytes(cfg, sh, True) == fl.peak  # tp=1: nothing gathered
    assert mm.loss_bytes(cfg, sh, False) == mm.logits_bytes(cfg, sh) == 6 * 256 * 128
    # The loss peaks in its forward, on top of what the stage keeps: with both layers kept
    # the loss phase (final norm 65536 + the fused loss) is above the layers' working set
    # (a vocabulary of 512 here, so that the loss's chunk of 2-byte logits binds).
    v512 = {"vocab_size": 512}
    big = lossmodel.fused_loss_bytes(256, 64, 512, act_bytes=2, wgrad="accumulate", impl="triton")
    cfg512 = small_config(model=v512)
    st = sum(mm.model_state_bytes(cfg512, 0).values())
    fused_on = small_config(model=v512, relaymoe={"fused_loss": True})
    for c, kw in ((cfg512, {"fused_loss": True}), (fused_on, {})):
        pk = stage_peak(c, 0, "alltoall", frozenset({0, 1}), **kw)
        assert pk.terms["logits_loss"] == 65536 + big.peak
        assert pk.terms["logits_loss"] > pk.terms["layer_working_set"]
        assert pk.total == st + pk.terms["activations_retained"] + 65536 + big.peak
    # the config's switch is the default; the keyword overrides it
    on = small_config(relaymoe={"fused_loss": True})
    assert stage_peak(on, 0, "ring").total == stage_peak(cfg, 0, "ring", fused_loss=True).total
    assert stage_peak(on, 0, "ring", fused_loss=False).total == stage_peak(cfg, 0, "ring").total
    # fp32 activations: the hidden gradient in fp32
    f32 = small_config(training={"precision": "fp32"})
    fl32 = lossmodel.fused_loss_bytes(256, 64, 128, act_bytes=4, wgrad="accumulate",
                                      impl="triton")  # fmt: skip
    assert mm.fused_loss_bytes(f32, mm.shapes(f32)) == fl32.peak != fl.peak


def test_fused_loss_sees_the_gathered_sequence():
    """With SP the output layer sees T_a = b*s/cp tokens (all-gathered over TP), and the vocab
    shard is the padded vocabulary over TP; the gathered input lives through the loss forward."""
    cfg = small_config(parallel={"tp": 2, "cp": 2, "dp": 1, "sequence_parallel": True})
    sh = mm.shapes(cfg)
    assert (sh.T_a, sh.T) == (128, 64)
    v = cfg.model.padded_vocab_size(2) // 2
    assert v == 128  # 128 padded to a multiple of 128 * tp = 256, over tp = 2
    fl = lossmodel.fused_loss_bytes(128, 64, v, act_bytes=2, wgrad="accumulate", impl="triton")
    assert mm.fused_loss_bytes(cfg, sh) == fl.peak
    assert mm.output_gather_bytes(sh) == 2 * 128 * 64
    assert mm.loss_bytes(cfg, sh, True) == fl.peak + 2 * 128 * 64
    pk = stage_peak(cfg, 0, "ring", frozenset({0, 1}), fused_loss=True)
    assert pk.terms["logits_loss"] == mm.final_norm_bytes(cfg, sh) + fl.peak + 2 * 128 * 64


def test_fused_loss_only_on_the_last_stage():
    cfg = small_config(model={"num_layers": 4}, parallel={"pp": 2})
    for fused in (False, True):
        first = stage_peak(cfg, 0, "ring", fused_loss=fused)
        last = stage_peak(cfg, 1, "ring", fused_loss=fused)
        assert first.terms["logits_loss"] == 0 and last.terms["logits_loss"] > 0
    a = stage_peak(cfg, 0, "ring", fused_loss=True).total
    assert a == stage_peak(cfg, 0, "ring", fused_loss=False).total


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "qwen2_57b_a14b", "table3/k4"])
def test_fused_loss_capacity_ordering(name):
    """At these lengths the (T, V/tp) logits dwarf one chunk: the fused loss never fits less,
    and with it the ring's smaller MoE working set is what the longer sequence is made of."""
    p = plan(load_config(name), "h200-141gb")
    seq, mbs = p.max_seq_length, p.max_micro_batch_size
    for d in ("alltoall", "ring"):
        assert seq[f"{d}_fused_loss"] >= seq[d] > 0, (d, seq)
        assert mbs[f"{d}_fused_loss"] >= mbs[d], (d, mbs)
    assert seq["ring_fused_loss"] >= seq["alltoall_fused_loss"], seq


def test_qwen3_plan_target_and_what_binds():
    """Issue #14's target: ring + fused loss >= 1.8x alltoall's longest sequence (H100 80 GB)."""
    cfg = load_config("qwen3_30b_a3b")
    p = plan(cfg, "h100-80gb")
    seq = p.max_seq_length
    assert seq["ring_fused_loss"] >= 1.8 * seq["alltoall"], seq
    q = seq_quantum(cfg)
    for v, (disp, fused) in VARIANTS.items():
        at = p.max_seq_breakdown[v]
        assert at["seq"] == seq[v]
        # the reported longest sequence fits and one quantum more does not
        for n, fits in ((seq[v], True), (seq[v] + q, False)):
            pk = stage_peak(cfg, at["stage"], disp, seq=n, fused_loss=fused)
            worst = max(stage_peak(cfg, s, disp, seq=n, fused_loss=fused).total for s in range(4))
            assert (worst <= p.usable_bytes) == fits, (v, n)
            if n == seq[v]:
                assert pk.total == worst and pk.terms == at["terms"]
        biggest = max(at["terms"], key=at["terms"].get)
        # Megatron's loss: the last stage's logits bind; the fused loss frees them
        assert (biggest == "logits_loss") == (not fused), (v, biggest)


def test_fused_loss_config_picks_the_plan_and_flags():
    # near Megatron's loss's longest sequence: its last stage's logits leave no room to keep
    # (491,520 since the presets are the driver's totals: 458,752 left room for 4 ring layers)
    cfg = load_config("qwen3_30b_a3b").replace(training={"seq_length": 491520})
    off = plan(cfg, "h100-80gb")
    on = plan(cfg.replace(relaymoe={"fused_loss": True}), "h100-80gb")
    assert (off.chosen, on.chosen) == ("ring", "ring_fused_loss")
    assert "--relaymoe-fused-loss" not in off.megatron_flags
    assert "--relaymoe-fused-loss" in on.megatron_flags
    assert on.recompute_plan == on.recompute_plans["ring_fused_loss"]
    assert off.recompute_plan == off.recompute_plans["ring"]
    # the variants themselves do not depend on the config's switch
    assert on.max_seq_length == off.max_seq_length and on.peak_bytes == off.peak_bytes
    # the fused loss leaves room to keep layers at this length
    kept = {v: len(on.recompute_plans[v]["kept_layers"]) for v in VARIANTS}
    assert kept["ring"] == kept["alltoall"] == 0, kept
    assert kept["ring_fused_loss"] > kept["alltoall_fused_loss"] > 0, kept
    # per stage: 12 layers, 4 kept, the first 8 recomputed: the planner's flags, with a note;
    # the flags themselves stay the config's (full uniform 1)
    planned = " ".join(on.planned_recompute_flags)
    assert "--recompute-method block --recompute-num-layers 8" in planned
    assert "--recompute-method uniform --recompute-num-layers 1" in " ".join(on.megatron_flags)
    assert any(planned in n and "--relaymoe-recompute-planner" in n for n in on.notes), on.notes
    assert "fused loss" in on.summary() and on.to_dict()["chosen"] == "ring_fused_loss"
    a2a = plan(cfg.replace(relaymoe={"fused_loss": True, "dispatcher": "alltoall"}), 80 * 10**9)
    assert a2a.chosen == "alltoall_fused_loss" and "--relaymoe-fused-loss" in a2a.megatron_flags


def test_fused_loss_from_megatron_args():
    args = small_megatron_args(moe_token_dispatcher_type="ring")
    assert config_from_megatron_args(args).relaymoe.fused_loss is False
    args.relaymoe_fused_loss = True
    assert config_from_megatron_args(args).relaymoe.fused_loss is True
    assert plan_from_megatron_args(args, gpu_bytes=4 * GiB).chosen == "ring_fused_loss"


def test_plan_picks_the_schedule_from_gpus_per_node():
    """Issue #18: the cluster shape picks the schedule (cost.choose_schedule) and the plan
    reports the hop times of both; across nodes the two-level ring is never slower."""
    from relaymoe.planner import ring_schedule

    cfg = load_config("qwen3_30b_a3b")  # EP=8
    one = plan(cfg, "h100-80gb")
    assert one.schedule == "flat" and one.gpus_per_node is None
    assert one.hop_times["flat"]["step_s"] == one.hop_times["two_level"]["step_s"]
    assert one.hop_times["flat"]["inter_hops"] == 0
    four = plan(cfg.replace(parallel={"gpus_per_node": 4}), "h100-80gb")
    assert four.schedule == ring_schedule(cfg.replace(parallel={"gpus_per_node": 4}))
    # across nodes the runtime runs NCCL on every hop, in either schedule
    assert four.schedule == "two_level" and four.transport == "nccl"
    assert one.transport == "copy_engine"  # the EP group in one node
    t = four.hop_times
    assert t["two_level"]["nodes"] == 2 and t["two_level"]["gpus_per_node"] == 4
    assert t["two_level"]["step_s"] < t["flat"]["step_s"]
    assert t["two_level"]["inter_hops"] < t["flat"]["inter_hops"]
    assert t["flat"]["mode"] in options.RING_MODES
    # one GPU per node: both orders are the same ring, all over NCCL (no copy engine)
    solo = plan(cfg.replace(parallel={"gpus_per_node": 1}), "h100-80gb")
    assert solo.schedule == "flat" and solo.transport == "nccl"
    assert "hop_times" in four.to_dict() and four.to_dict()["schedule"] == "two_level"


def test_gpus_per_node_from_megatron_args():
    """``--relaymoe-gpus-per-node`` (issue #18) reaches the plan at training start."""
    ns = small_megatron_args(
        expert_model_parallel_size=4,
        data_parallel_size=4,
        world_size=4,
        moe_token_dispatcher_type="ring",
        relaymoe_gpus_per_node=2,
    )
    cfg = config_from_megatron_args(ns)
    assert cfg.parallel.gpus_per_node == 2
    assert plan_from_megatron_args(ns, gpu_bytes="80GiB").schedule == "two_level"
    assert config_from_megatron_args(small_megatron_args()).parallel.gpus_per_node is None


def test_gpu_presets_are_the_drivers_totals():
    """Issue #32: a preset is the total nvidia-smi reports (H100 80GB HBM3 81,559 MiB, H200
    143,771 MiB); the CUDA context is one named reserve taken off it in usable_bytes."""
    import importlib

    plan_mod = importlib.import_module("relaymoe.planner.plan")  # the module, not plan()

    GPU_TOTAL_MIB, GPUS = plan_mod.GPU_TOTAL_MIB, plan_mod.GPUS
    context = plan_mod.CUDA_CONTEXT_BYTES

    assert GPU_TOTAL_MIB["h100-80gb"] == 81_559 and GPU_TOTAL_MIB["h200-141gb"] == 143_771
    for name, mib in GPU_TOTAL_MIB.items():
        assert GPUS[name] == parse_gpu(name) == mib * 2**20
    h100 = GPUS["h100-80gb"]
    assert h100 / GiB > 79.6  # no longer 80e9 bytes (74.5 GiB)
    want = int((h100 - context) * (1 - plan_mod.RESERVE_FRACTION) - plan_mod.RESERVE_FIXED)
    assert usable_bytes(h100) == want < h100 - context


def test_a_gpu_too_small_for_the_reserves_is_refused():
    """Issue #32: ``--gpu 2GiB`` printed "usable -0.06 GiB"; now nothing negative is planned."""
    from relaymoe.planner.plan import min_gpu_bytes

    smallest = min_gpu_bytes()
    assert usable_bytes(smallest) > 0
    with pytest.raises(ValueError, match="leaves nothing usable"):
        usable_bytes(smallest - 1)
    with pytest.raises(ValueError, match=r"--gpu '2GiB' is 2.00 GiB.*more than 3.1"):
        parse_gpu("2GiB")
    with pytest.raises(ValueError, match="--gpu 1000 is"):
        parse_gpu(1000)


# -- recompute policies (issue #53): megatron-core's selective set, none, the ring's plan ------


def test_selective_recompute_terms_hand_computed():
    """megatron-core's selective modules on small_config's layer 0 (alltoall): what each
    module takes off what the layer keeps, and what its backward brings back."""
    cfg = small_config()
    sh = mm.shapes(cfg)
    moe_peak = mm.moe_peak_alltoall(sh)  # 419840 (test_terms_hand_computed)
    row = 2 * 256 * 64  # one (T, h) bf16 activation

    def rx(*modules, impl=mm.TE_IMPL):
        return mm.selective_layer_bytes(cfg, sh, 0, "alltoall", None, moe_peak,
                                        frozenset(modules), impl)  # fmt: skip

    kept = 167936 + 2 * row + 174080  # attention + the pre-MLP norm + alltoall's inner keep
    assert rx() == (kept, moe_peak - 174080)  # nothing recomputed: the kept layer's numbers
    # core_attn: the lse (4*256*4) goes; back in the backward with the output (2*256*4*16),
    # beside flash's gradients (131072); the MoE's rest (245760) is the larger
    assert rx("core_attn") == (kept - 4096, max(131072 + 4096 + 32768, moe_peak - 174080))
    # layernorm: the pre-MLP norm's output goes; under local layers the input norm's as well
    assert rx("layernorm")[0] == kept - row
    assert rx("layernorm", impl=mm.LOCAL_IMPL)[0] == kept - 2 * row
    # moe_act: the expert activation's output (P, I) = 2*512*32 goes, recomputed in backward
    assert rx("moe_act") == (kept - 32768, moe_peak - 174080 + 32768)
    # moe: the MoE layer keeps its input only; its backward rebuilds the block's working set
    r, x = rx("moe_act", "layernorm", "core_attn", "moe")
    assert r == 167936 - 4096 + row and x == moe_peak + row
    # the whole stage: both layers keep that much, and the last one's backward adds x
    pk = stage_peak(cfg, 0, "alltoall", recompute_modules=("moe_act", "layernorm", "core_attn",
                                                           "moe"))  # fmt: skip
    assert pk.terms["activations_retained"] == 2 * r and pk.terms["layer_working_set"] == x
    full = stage_peak(cfg, 0, "alltoall")
    assert pk.total > full.total  # the attention activations it keeps outweigh full recompute
    with pytest.raises(ValueError, match="mlp"):
        rx("mlp")
    with pytest.raises(ValueError, match="transformer_impl"):
        rx("moe", impl="inference_optimized")


def test_policy_predictions_under_te_on_one_h100():
    """qwen3_slice_v152k at EP 1 on an H100 80GB: each variant's longest sequence per policy
    (the planner's, TE) and the term that binds it."""
    from relaymoe.planner import policies as pol
    from relaymoe.planner.plan import policy_max_seq, policy_report

    cfg = load_config("qwen3_slice_v152k").replace(
        parallel={"ep": 1, "dp": 1}, training={"global_batch_size": None}
    )
    usable = usable_bytes(parse_gpu("h100-80gb"))
    rep = policy_report(cfg, usable)
    seq = {v: {p: rep[v][p]["max_seq"] for p in pol.POLICIES} for v in VARIANTS}
    for v, (disp, fused) in VARIANTS.items():
        s = seq[v]
        assert s["none"] < s["full"] and 0 < s["none"], (v, s)
        assert s["full"] == max_seq_length_of(cfg, disp, usable, fused)  # the old full column
        assert policy_max_seq(cfg, disp, "full", usable, fused_loss=fused) == s["full"]
        if disp == "ring":  # the plan fits exactly where full recompute does
            assert s["selective"] == s["full"]
        else:  # megatron-core's set keeps the attention activations: less than full
            assert s["none"] < s["selective"] < s["full"]
    # what binds: the logits with Megatron's loss; with the fused loss the layers' working set
    # under full recompute and what the layers keep without recompute
    assert {rep[v][p]["binding_term"] for v in ("alltoall", "ring") for p in pol.POLICIES} == {
        "logits_loss"
    }
    for v in ("alltoall_fused_loss", "ring_fused_loss"):
        assert rep[v]["full"]["binding_term"] == "layer_working_set"
        assert rep[v]["none"]["binding_term"] == "activations_retained"
    # the ring's gain over alltoall at equal (fused) loss, every policy: its hops' intermediates
    # stop growing at one slice (KernelOptions.hop_slice_mib), alltoall's grow as T*K
    gain = {p: seq["ring_fused_loss"][p] / seq["alltoall_fused_loss"][p] for p in pol.POLICIES}
    assert min(gain.values()) > 2.0, gain
    # one planner: the Plan carries the report, and megatron-core's own flags for alltoall
    p = plan(cfg.replace(relaymoe={"dispatcher": "alltoall"}), "h100-80gb")
    assert p.policies == rep and p.transformer_impl == mm.TE_IMPL
    assert list(p.mcore_memory_flags) == pol.mcore_memory_flags()
    assert plan(cfg, "h100-80gb").mcore_memory_flags == ()  # the ring's user: none


def max_seq_length_of(cfg, disp, usable, fused):
    from relaymoe.planner.plan import max_seq_length

    return max_seq_length(cfg, disp, usable, fused_loss=fused)


def test_policy_flags_are_written_once():
    from relaymoe.planner import policies as pol

    assert pol.policy_flags("full", "ring") == pol.policy_flags("full", "alltoall") == [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
    ]  # fmt: skip
    assert pol.policy_flags("none", "alltoall") == []
    assert pol.policy_flags("selective", "alltoall") == [
        "--recompute-granularity", "selective", "--recompute-modules", "moe_act", "layernorm",
        "core_attn", "moe",
    ]  # fmt: skip
    assert pol.policy_flags("selective", "ring", ("--x",)) == ["--x"]
    with pytest.raises(ValueError, match="planned_recompute_flags"):
        pol.policy_flags("selective", "ring")
    with pytest.raises(ValueError, match="known: full, selective, none"):
        pol.policy_flags("some", "ring")
    assert pol.mcore_memory_flags()[-3:] == list(pol.MCORE_FUSED_CE_FLAGS)


# -- gradient-accumulation fusion: the ring's expert weight gradients into main_grad ------------


def test_gradient_accumulation_fusion_removes_the_rings_weight_gradient_buffer():
    """Megatron's gradient-accumulation fusion (its default) hands the ring its experts'
    ``main_grad``: at world 1 the weight-gradient kernel adds into it, so no bf16 ``(El, J, H) +
    (El, H, I)`` buffer (4*3*64*32*2 bytes here) is counted; ``--no-gradient-accumulation-
    fusion`` brings it back. The alltoall baseline does not move. The switch travels from the
    config to the flags and from Megatron's arguments to the config."""
    on, off = small_config(), small_config(training={"gradient_accumulation_fusion": False})
    W = 4 * 3 * 64 * 32 * 2
    for mode in options.MODES:  # a world of one computes locally whatever the mode
        gap = mm.moe_peak_ring(mm.shapes(off), mode) - mm.moe_peak_ring(mm.shapes(on), mode)
        assert gap == W, mode
    full_on, full_off = stage_peak(on, 0, "ring"), stage_peak(off, 0, "ring")
    assert full_off.terms["moe_block_peak"] - full_on.terms["moe_block_peak"] == W
    assert full_off.total - full_on.total == W  # the last layer's backward binds here
    assert stage_peak(on, 0, "alltoall").total == stage_peak(off, 0, "alltoall").total
    gpu = usable_bytes(parse_gpu("h100-80gb"))
    qwen = load_config("qwen3_slice_v152k").replace(  # as benchmarks/max_seq.py plans it
        parallel={"ep": 1, "dp": 1}, training={"micro_batch_size": 1, "global_batch_size": None}
    )
    qwen_off = qwen.replace(training={"gradient_accumulation_fusion": False})
    from relaymoe.planner.plan import max_seq_length

    assert max_seq_length(qwen, "ring", gpu, fused_loss=True) > max_seq_length(
        qwen_off, "ring", gpu, fused_loss=True
    )
    # the flags, and Megatron's arguments read back
    assert "--no-gradient-accumulation-fusion" in to_megatron_args(off)
    assert "--no-gradient-accumulation-fusion" not in to_megatron_args(on)
    from relaymoe.config import megatron_namespace

    assert megatron_namespace(to_megatron_args(off)).gradient_accumulation_fusion is False
    args = small_megatron_args()
    assert config_from_megatron_args(args).training.gradient_accumulation_fusion is True
    args.gradient_accumulation_fusion = False  # what --no-gradient-accumulation-fusion sets
    assert config_from_megatron_args(args).training.gradient_accumulation_fusion is False
    with pytest.raises(ValueError, match="gradient_accumulation_fusion='no' must be true or"):
        small_config(training={"gradient_accumulation_fusion": "no"})
