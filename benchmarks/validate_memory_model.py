"""Validate the planner's memory model (``relaymoe.planner``) against measured peaks on one GPU.

For each configuration a small GPT-MoE model is built with megatron-core (local spec, no
TransformerEngine; core attention replaced by a flash-style ``scaled_dot_product_attention``
module, since the planner models flash attention and the local ``DotProductAttention``
materialises the ``(b, heads, s, s)`` scores), wrapped in megatron's ``DistributedDataParallel``
(fp32 grad buffer) with megatron's distributed optimizer (Adam; without TE/apex megatron-core
falls back to ``torch.optim.AdamW``), and trained for two steps in bf16 with world size 1.

What is measured (the second step; the first one creates the optimizer states lazily):

* ``states_MiB``: ``memory_allocated()`` after the first step (bf16 params, fp32 grad buffer,
  fp32 main params + Adam m and v, and any persistent workspaces) minus before the build;
* ``measured_MiB``: ``max_memory_allocated()`` over forward + backward + optimizer step of the
  second step, with the peak statistics reset after the states exist, minus before the build:
  so the states are included, as the planner includes them;
* ``fwd_bwd_peak_MiB`` / ``optim_peak_MiB``: the same peak restricted to forward+backward and
  to the optimizer step (``peak_phase`` says which one is the overall peak);
* ``fwd_retained_MiB``: allocated after the forward (loss computed) minus ``states_MiB``.

Predicted: ``relaymoe.planner.recompute.stage_peak`` for the same config (tp=cp=pp=ep=dp=1
(world 1, ``kept`` = the layers Megatron does not recompute), with its terms. ``rel_err`` =
(predicted - measured) / measured. ``rel_err_states`` and ``rel_err_act`` compare the state and
the activation (peak minus states) parts separately. The model is built with the local spec,
whose norms are apex's fused ones when apex is importable and megatron-core's torch fallback
otherwise, so the planner config says ``training.normalization_impl`` accordingly
(``norm_impl_planner``); ``predicted_fused_norm_MiB`` / ``rel_err_fused_norm`` give the
planner's figure with fused norms (the TE/apex build) beside it, to show that term's size.

Run: ``python3 benchmarks/validate_memory_model.py [--quick] [--out PATH]``;
``--plan-only`` prints the predictions without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `relaymoe` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relaymoe.config import Config, config_from_dict  # noqa: E402
from relaymoe.planner import memory as mm  # noqa: E402
from relaymoe.planner.recompute import stage_peak  # noqa: E402

MiB = 1024 * 1024
TOLERANCE = 0.10  # the bar: within 10%
# the model trains without DDP: weight gradients reach .grad (no main_grad to fuse into), and
# the planner is told so (its ring keeps the experts' weight-gradient buffer)
GRADIENT_ACCUMULATION_FUSION = False
# Megatron training's default (--bias-swiglu-fusion): the experts' SwiGLU and probability
# weighting run fused (``weighted_bias_swiglu_impl``, a torch.jit function: no TE needed).
# [False] reproduces the first H200 run (unfused: four (P, I) tensors kept instead of one).
SWIGLU_FUSION = [True]

# Model defaults (Qwen3-style: GQA, qk-layernorm, RMSNorm, SwiGLU experts, untied embeddings).
BASE_MODEL = dict(
    num_layers=2,
    hidden_size=1024,
    num_attention_heads=16,
    num_query_groups=4,
    kv_channels=64,
    num_experts=16,
    moe_router_topk=4,
    moe_ffn_hidden_size=512,
    ffn_hidden_size=2048,
    vocab_size=8192,
    qk_layernorm=True,
    moe_grouped_gemm=False,  # SequentialMLP: what the local (no-TE) spec builds
)


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    name: str
    seq: int
    mbs: int
    dispatcher: str = "alltoall"  # alltoall | allgather | ring
    recompute: str | None = None  # None | "full_uniform" | "full_block:N"
    model: dict = field(default_factory=dict)  # overrides of BASE_MODEL
    quick: bool = False  # part of --quick

    @property
    def model_dict(self) -> dict:
        return {**BASE_MODEL, **self.model}

    @property
    def num_layers(self) -> int:
        return self.model_dict["num_layers"]

    def recompute_settings(self) -> tuple[str | None, str | None, int | None]:
        """(recompute_granularity, recompute_method, recompute_num_layers) as Megatron's."""
        if self.recompute is None:
            return None, None, None
        if self.recompute == "full_uniform":
            return "full", "uniform", 1
        if self.recompute.startswith("full_block:"):
            n = int(self.recompute.split(":", 1)[1])
            if not 1 <= n <= self.num_layers:
                raise ValueError(
                    f"case {self.name}: recompute {self.recompute!r} needs 1 <= N <= "
                    f"num_layers={self.num_layers}"
                )
            return "full", "block", n
        raise ValueError(
            f"case {self.name}: recompute={self.recompute!r}; known: None, 'full_uniform', "
            "'full_block:N'"
        )

    def kept_layers(self) -> frozenset[int]:
        """Layers whose activations are kept (not recomputed), Megatron's semantics (pp=1)."""
        gran, method, n = self.recompute_settings()
        L = self.num_layers
        if gran is None:
            return frozenset(range(L))
        if method == "uniform":
            return frozenset()  # every chunk of n layers is checkpointed: all recomputed
        return frozenset(range(n, L))  # block: the first n layers are recomputed


CASES: tuple[Case, ...] = (
    Case("base_s4k_b2", 4096, 2, quick=True),
    Case("base_s4k_b2_ring", 4096, 2, dispatcher="ring", quick=True),
    Case("seq8k_b1", 8192, 1),
    Case("mbs4_s2k", 2048, 4, quick=True),
    Case("L4_s4k_b2", 4096, 2, model={"num_layers": 4}),
    Case("E64_K8_I256", 4096, 2, model={"num_experts": 64, "moe_router_topk": 8,
                                        "moe_ffn_hidden_size": 256}, quick=True),
    Case("E8_K1_I1024", 4096, 2, model={"num_experts": 8, "moe_router_topk": 1,
                                        "moe_ffn_hidden_size": 1024}),
    Case("L4_full_recompute", 4096, 4, recompute="full_uniform", model={"num_layers": 4},
         quick=True),
    Case("L4_full_recompute_ring", 4096, 4, dispatcher="ring", recompute="full_uniform",
         model={"num_layers": 4}),
    Case("L4_block2", 4096, 2, recompute="full_block:2", model={"num_layers": 4}, quick=True),
    Case("E64_K8_ring", 4096, 2, dispatcher="ring", model={"num_experts": 64,
         "moe_router_topk": 8, "moe_ffn_hidden_size": 256}),
    Case("allgather_s4k_b2", 4096, 2, dispatcher="allgather"),
)  # fmt: skip


def local_spec_norm_impl() -> str:
    """``normalization_impl`` of megatron-core's local spec here: apex's FusedLayerNorm when
    apex is importable, else the torch fallback (``WrappedTorchNorm``: ``torch`` or
    ``torch_composite`` by this torch, ``benchmarks.common.torch_norm_impl``). TransformerEngine
    does not matter: the script builds the local spec (no TE modules)."""
    import importlib.util

    from benchmarks.common import torch_norm_impl

    return "fused" if importlib.util.find_spec("apex") is not None else torch_norm_impl()


def planner_config(case: Case, normalization_impl: str | None = None) -> Config:
    """The ``relaymoe.config.Config`` of a case: one GPU, distributed optimizer, bf16, norms as
    this machine's local spec builds them unless ``normalization_impl`` says otherwise."""
    gran, method, n = case.recompute_settings()
    model = dict(case.model_dict)
    model["max_position_embeddings"] = case.seq
    return config_from_dict(
        {
            "model": model,
            "parallel": {
                "tp": 1,
                "cp": 1,
                "pp": 1,
                "ep": 1,
                "etp": 1,
                "dp": 1,
                "sequence_parallel": False,
                "use_distributed_optimizer": True,
            },
            "training": {
                "seq_length": case.seq,
                "micro_batch_size": case.mbs,
                "global_batch_size": case.mbs,
                "precision": "bf16",
                "recompute_granularity": gran,
                "recompute_method": method,
                "recompute_num_layers": n,
                "normalization_impl": normalization_impl or local_spec_norm_impl(),
                "gradient_accumulation_fusion": GRADIENT_ACCUMULATION_FUSION,
            },
            "relaymoe": {"dispatcher": case.dispatcher},
        },
        name=case.name,
    )


def planner_dispatcher(dispatcher: str) -> str:
    """The planner models ``ring`` and ``alltoall``; allgather at EP=1 is judged by the
    alltoall formula (same expanded buffers; said in the row's ``model_note``)."""
    return "ring" if dispatcher == "ring" else "alltoall"


def predict(case: Case, normalization_impl: str | None = None) -> dict:
    """Planner prediction for a case: total bytes and the terms (bytes)."""
    cfg = planner_config(case, normalization_impl)
    pk = stage_peak(
        cfg, 0, planner_dispatcher(case.dispatcher), case.kept_layers(), ring_mode="expert"
    )
    t = pk.terms
    states = t["params"] + t["grads"] + t["optimizer"]
    sh = mm.shapes(cfg)
    disp = planner_dispatcher(case.dispatcher)
    layer = {
        "attention_keep": mm.attention_keep_bytes(cfg, sh, 0),
        "moe_keep": mm.moe_keep_bytes(cfg, sh, 0, disp),
        "layer_input": mm.layer_input_bytes(sh),
        "moe_peak": mm.moe_peak_ring(sh, "expert") if disp == "ring" else mm.moe_peak_alltoall(sh),
        "logits": mm.logits_bytes(cfg, sh),
        "final_norm": mm.final_norm_bytes(cfg, sh),
        "norm_extra": mm.norm_extra_bytes(cfg, sh, "attention", 0)
        + mm.norm_extra_bytes(cfg, sh, "mlp"),
    }
    return {
        "normalization_impl": cfg.training.normalization_impl,
        "layer": layer,
        "total": pk.total,
        "states": states,
        "activations": pk.total - states,
        "terms": dict(t),
        "params": mm.total_params(cfg),
    }


def compare(case: Case, measured: dict, predicted: dict) -> dict:
    """A result row from measured bytes (``peak``, ``states``, ...) and a prediction."""

    def mib(x):
        return None if x is None else round(x / MiB, 1)

    def rel(p, m):
        return None if not m else round((p - m) / m, 4)

    peak, states = measured["peak"], measured["states"]
    fused_total = (
        predicted["total"]
        if predicted["normalization_impl"] == "fused"
        else predict(case, "fused")["total"]
    )
    row = {
        "bench": "memory_model",
        "config": case.name,
        "dispatcher": case.dispatcher,
        "seq": case.seq,
        "mbs": case.mbs,
        "num_layers": case.num_layers,
        "num_experts": case.model_dict["num_experts"],
        "topk": case.model_dict["moe_router_topk"],
        "moe_ffn": case.model_dict["moe_ffn_hidden_size"],
        "recompute": case.recompute or "none",
        "ep": 1,
        "measured_MiB": mib(peak),
        "predicted_MiB": mib(predicted["total"]),
        "rel_err": rel(predicted["total"], peak),
        "within_10pct": abs(predicted["total"] - peak) <= TOLERANCE * peak,
        "norm_impl_planner": predicted["normalization_impl"],
        "predicted_fused_norm_MiB": mib(fused_total),
        "rel_err_fused_norm": rel(fused_total, peak),
        "states_MiB": mib(states),
        "predicted_states_MiB": mib(predicted["states"]),
        "rel_err_states": rel(predicted["states"], states),
        "act_MiB": mib(peak - states),
        "predicted_act_MiB": mib(predicted["activations"]),
        "rel_err_act": rel(predicted["activations"], peak - states),
        "fwd_retained_MiB": mib(measured.get("fwd_retained")),
        "predicted_retained_MiB": mib(predicted["terms"]["activations_retained"]),
        "fwd_bwd_peak_MiB": mib(measured.get("fwd_bwd_peak")),
        "optim_peak_MiB": mib(measured.get("optim_peak")),
        "peak_phase": measured.get("peak_phase"),
        "predicted_terms_MiB": {k: mib(v) for k, v in predicted["terms"].items()},
        "layer_retained_MiB": [mib(x["retained"]) for x in measured.get("layers", [])],
        "layer_attn_part_MiB": [mib(x["attn_part"]) for x in measured.get("layers", [])],
        "layer_mlp_part_MiB": [mib(x["mlp_part"]) for x in measured.get("layers", [])],
        "predicted_layer_MiB": {k: mib(v) for k, v in predicted["layer"].items()},
        "params": predicted["params"],
        "optimizer_impl": measured.get("optimizer_impl"),
        "swiglu_fusion": SWIGLU_FUSION[0],
        "norm_impl": measured.get("norm_impl"),
        "attention": measured.get("attention"),
        "counted": "max_memory_allocated over step 2 (fwd+bwd+optimizer), peak stats reset "
        "after step 1 created the states; states included; baseline = allocated before build",
    }
    if case.dispatcher == "allgather":
        row["model_note"] = "planner has no allgather term; alltoall formula used"
    return row


# ---------------------------------------------------------------------------------- GPU part


ATTENTION_PATH: set[str] = set()  # which SDPA path the attention took (reported per row)


def _flash_core_attention_cls():
    """A megatron ``core_attention`` module computing causal attention with torch SDPA (flash
    backend on H100/H200): saves q, k, v, the output and the fp32 logsumexp, like TE's."""
    import torch
    from megatron.core.transformer.module import MegatronModule

    class FlashCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
            super().__init__(config=config)
            self.scale = kwargs.get("softmax_scale")

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):  # fmt: skip
            # [s, b, n, d] -> [b, n, s, d] (views; flash reads any stride with a unit last dim)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            gqa = q.shape[1] != k.shape[1]
            from torch.nn.attention import SDPBackend, sdpa_kernel

            sdpa = torch.nn.functional.scaled_dot_product_attention
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    out = sdpa(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
                ATTENTION_PATH.add("flash" + ("_gqa" if gqa else ""))
            except RuntimeError:  # no flash kernel for GQA here: expand k/v (costs memory)
                r = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                    out = sdpa(q, k, v, is_causal=True, scale=self.scale)
                ATTENTION_PATH.add("sdpa_kv_expanded")
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return FlashCoreAttention


_DIST_READY = False


def _init_dist():
    global _DIST_READY
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if _DIST_READY:
        return
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    _DIST_READY = True


def transformer_config_kwargs(case: Case) -> dict:
    """TransformerConfig arguments of a case (importable without a GPU)."""
    import torch
    import torch.nn.functional as F

    m = case.model_dict
    gran, method, n = case.recompute_settings()
    # the model keys TransformerConfig takes under the same name (vocab_size goes to GPTModel)
    same = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "kv_channels", "moe_router_topk", "moe_ffn_hidden_size",
            "moe_grouped_gemm", "qk_layernorm")  # fmt: skip
    return dict(
        **{k: m[k] for k in same},
        num_moe_experts=m["num_experts"],
        moe_token_dispatcher_type=case.dispatcher,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_router_pre_softmax=m["moe_router_topk"] == 1,  # megatron requires it for top-1
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=GRADIENT_ACCUMULATION_FUSION,
        bias_activation_fusion=SWIGLU_FUSION[0],  # megatron training's --bias-swiglu-fusion
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        recompute_granularity=gran,
        recompute_method=method,
        recompute_num_layers=n,
    )


def build_gpt(case: Case, *, cpu: bool = False):
    """(megatron GPTModel of a case, its TransformerConfig); ``cpu=True`` initialises on the
    CPU (tests; megatron's alltoall dispatcher and router still need CUDA to run)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if case.dispatcher == "ring":
        import relaymoe.megatron

        relaymoe.megatron.register()
    m = case.model_dict
    tc = TransformerConfig(**transformer_config_kwargs(case), use_cpu_initialization=cpu)
    spec = get_gpt_layer_local_spec(
        num_experts=m["num_experts"],
        moe_grouped_gemm=m["moe_grouped_gemm"],
        qk_layernorm=m["qk_layernorm"],
        normalization="RMSNorm",
    )
    spec.submodules.self_attention.submodules.core_attention = _flash_core_attention_cls()
    model = GPTModel(
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=m["vocab_size"],
        max_sequence_length=case.seq,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=1000000,
    )
    return model, tc


def build(case: Case):
    """(DDP-wrapped GPTModel, megatron optimizer, optimizer class name)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model, tc = build_gpt(case)
    model = model.cuda()
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    model = DistributedDataParallel(tc, ddp_cfg, model)
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=1e-4,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    opt = get_megatron_optimizer(opt_cfg, [model])
    inner = opt
    for _ in range(3):  # ChainedOptimizer -> DistributedOptimizer -> torch/apex/TE Adam
        if hasattr(inner, "chained_optimizers"):
            inner = inner.chained_optimizers[0]
        elif hasattr(inner, "optimizer"):
            inner = inner.optimizer
    return model, opt, type(inner).__module__ + "." + type(inner).__name__


def _norm_impl(ddp_model) -> str:
    """The class of the layers' input norm (torch's RMSNorm without TE/apex: composite in
    fp32, it keeps an fp32 copy of its input and the fp32 normalised tensor for backward)."""
    norm = ddp_model.module.decoder.layers[0].input_layernorm
    inner = getattr(norm, "norm", None) or norm
    return type(norm).__name__ + ("/" + type(inner).__name__ if inner is not norm else "")


class _LayerProbe:
    """Forward hooks reading the allocator (no sync, no peak reset: the step's peak is
    untouched) around each decoder layer, its attention and its MLP, first forward only (a
    recomputing backward replays them; those calls are ignored)."""

    def __init__(self, ddp_model):
        import torch

        self.torch = torch
        self.marks: dict[tuple[int, str], int] = {}
        self.handles = []
        layers = ddp_model.module.decoder.layers
        for i, layer in enumerate(layers):
            self._hook(layer, i, "layer")
            self._hook(layer.self_attention, i, "attn")
            self._hook(layer.mlp, i, "mlp")

    def _hook(self, mod, i, tag):
        def pre(_m, _a):
            self.marks.setdefault((i, tag + "_pre"), self.torch.cuda.memory_allocated())

        def post(_m, _a, _o):
            self.marks.setdefault((i, tag + "_post"), self.torch.cuda.memory_allocated())

        self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def remove(self):
        for h in self.handles:
            h.remove()

    def summary(self) -> list[dict]:
        """Per layer: bytes still allocated after its forward (the layer output included),
        split at the attention's end (input norm + attention) and the MLP's end (residual,
        pre-MLP norm, router, dispatcher, experts)."""
        out = []
        n = 1 + max((i for i, _ in self.marks), default=-1)
        for i in range(n):
            m = {k: v for (j, k), v in self.marks.items() if j == i}
            if not {"layer_pre", "attn_post", "mlp_post", "layer_post"} <= set(m):
                continue
            out.append(
                {
                    "layer": i,
                    "retained": m["layer_post"] - m["layer_pre"],
                    "attn_part": m["attn_post"] - m["layer_pre"],
                    "mlp_part": m["mlp_post"] - m["attn_post"],
                }
            )
        return out


def measure(case: Case) -> dict:
    """Bytes: states, peak (states included), phase peaks, forward-retained."""
    import torch

    _init_dist()
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()  # global, sized by the first model's layer count
    dev = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model, opt, opt_impl = build(case)
    V, b, s = case.model_dict["vocab_size"], case.mbs, case.seq
    g = torch.Generator(device=dev).manual_seed(0)
    tokens = torch.randint(0, V, (b, s), device=dev, generator=g)
    labels = torch.randint(0, V, (b, s), device=dev, generator=g)
    pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)

    def forward():
        return model(tokens, pos, None, labels=labels).float().mean()

    def backward_and_sync(loss):
        loss.backward()
        model.finish_grad_sync()

    def step(record: dict | None):
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = forward()
        if record is not None:
            torch.cuda.synchronize()
            record["after_fwd"] = torch.cuda.memory_allocated() - base
        backward_and_sync(loss)
        del loss
        if record is not None:
            torch.cuda.synchronize()
            record["fwd_bwd_peak"] = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
        ok, _, _ = opt.step()
        if record is not None:
            torch.cuda.synchronize()
            record["optim_peak"] = torch.cuda.max_memory_allocated() - base
            record["step_ok"] = bool(ok)

    step(None)  # creates Adam's states, cuBLAS workspaces, rotary caches
    torch.cuda.synchronize()
    states = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    rec: dict = {}
    probe = _LayerProbe(model)
    ATTENTION_PATH.clear()
    t0 = time.perf_counter()
    step(rec)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    probe.remove()
    peak = max(rec["fwd_bwd_peak"], rec["optim_peak"])
    out = {
        "states": states,
        "peak": peak,
        "fwd_bwd_peak": rec["fwd_bwd_peak"],
        "optim_peak": rec["optim_peak"],
        "peak_phase": "fwd_bwd" if rec["fwd_bwd_peak"] >= rec["optim_peak"] else "optimizer",
        "fwd_retained": rec["after_fwd"] - states,
        "optimizer_impl": f"megatron DistributedOptimizer over {opt_impl}",
        "step_ms": round(ms, 1),
        "step_ok": rec["step_ok"],
        "layers": probe.summary(),
        "norm_impl": _norm_impl(model),
        "attention": "+".join(sorted(ATTENTION_PATH)),
    }
    return out  # the model and optimizer go with this frame; the next case collects them


COLUMNS = [
    "config", "dispatcher", "recompute", "measured_MiB", "predicted_MiB", "rel_err",
    "rel_err_fused_norm",
    "states_MiB", "predicted_states_MiB", "act_MiB", "predicted_act_MiB", "rel_err_act",
    "fwd_retained_MiB", "predicted_retained_MiB", "peak_phase",
]  # fmt: skip


def select(quick: bool, names: list[str] | None) -> list[Case]:
    cases = [c for c in CASES if c.quick] if quick else list(CASES)
    if names:
        known = {c.name: c for c in CASES}
        bad = [n for n in names if n not in known]
        if bad:
            raise SystemExit(f"unknown --configs {bad}; known: {sorted(known)}")
        cases = [known[n] for n in names]
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/memory_model.jsonl")
    ap.add_argument("--quick", action="store_true", help="the quick subset (< 60 s on an H200)")
    ap.add_argument("--configs", nargs="*", help="run only these configuration names")
    ap.add_argument("--plan-only", action="store_true", help="predictions only (no GPU)")
    ap.add_argument(
        "--no-swiglu-fusion",
        action="store_true",
        help="unfused expert SwiGLU + probability weighting (megatron's --no-bias-swiglu-fusion)",
    )
    ap.add_argument(
        "--normalization-impl",
        choices=["auto", "fused", "torch", "torch_composite"],
        default="auto",
        help="the planner's norm model (auto: as the local spec builds it here, see "
        "local_spec_norm_impl; the others only for --plan-only what-ifs)",
    )
    args = ap.parse_args(argv)
    SWIGLU_FUSION[0] = not args.no_swiglu_fusion
    norm_impl = None if args.normalization_impl == "auto" else args.normalization_impl
    if norm_impl is not None and not args.plan_only and norm_impl != local_spec_norm_impl():
        raise SystemExit(
            f"--normalization-impl {norm_impl} differs from what this machine builds "
            f"({local_spec_norm_impl()}); use it with --plan-only, or leave it at auto"
        )
    cases = select(args.quick, args.configs)

    if args.plan_only:
        rows = []
        for c in cases:
            p = predict(c, norm_impl)
            rows.append({"config": c.name, "dispatcher": c.dispatcher,
                         "recompute": c.recompute or "none",
                         "norm_impl": p["normalization_impl"],
                         "predicted_MiB": round(p["total"] / MiB, 1),
                         "predicted_states_MiB": round(p["states"] / MiB, 1),
                         "predicted_act_MiB": round(p["activations"] / MiB, 1)})  # fmt: skip
        from benchmarks.common import print_table

        print_table(rows, ["config", "dispatcher", "recompute", "norm_impl", "predicted_MiB",
                           "predicted_states_MiB", "predicted_act_MiB"])  # fmt: skip
        return 0

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("validate_memory_model needs a CUDA GPU (use --plan-only without one)")
    from benchmarks.common import JsonlWriter, environment, print_table

    writer = JsonlWriter(args.out, env=environment())
    t_start = time.perf_counter()
    for c in cases:
        t0 = time.perf_counter()
        try:
            meas = measure(c)
        except Exception as e:  # one failing config (e.g. the ring) must not hide the others
            import traceback

            traceback.print_exc()
            writer.write({"bench": "memory_model", "config": c.name, "dispatcher": c.dispatcher,
                          "error": f"{type(e).__name__}: {e}"[:600]})  # fmt: skip
            continue
        row = compare(c, meas, predict(c))
        row["step_ms"] = meas["step_ms"]
        row["step_ok"] = meas["step_ok"]
        row["case_s"] = round(time.perf_counter() - t0, 1)
        writer.write(row)
        print(f"{c.name}: measured {row['measured_MiB']} MiB, predicted {row['predicted_MiB']} "
              f"MiB, rel_err {row['rel_err']}  ({row['case_s']} s)", flush=True)  # fmt: skip
    print(f"total {time.perf_counter() - t_start:.1f} s")
    ok = [r for r in writer.rows if "error" not in r]
    print_table(ok, COLUMNS)
    for r in writer.rows:
        if "error" in r:
            print(f"ERROR {r['config']}: {r['error']}")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
