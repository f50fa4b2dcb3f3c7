"""``te_grouped``: megatron-core's expert path with TransformerEngine, a layer-level provider.

What an alltoall MoE layer of megatron-core 0.19.2 runs between its router and its combine on
one GPU (EP 1), with the MoE fusions a user turns on (``--moe-grouped-gemm``,
``--moe-permute-fusion``): TE's fused ``permute`` of the tokens and router probabilities into
expert order, ``TEGroupedMLP`` (TE ``GroupedLinear`` fc1, megatron-core's fused weighted SwiGLU,
TE ``GroupedLinear`` fc2) and TE's fused ``unpermute``. ``benchmarks/bench_experts.py`` times it
beside relaymoe, naive and liger on the same inputs; its weights are copies of the shared
``w13``/``w2`` (fc1 rows ``[0, I)`` gate, ``[I, 2I)`` up: the same layout), and
``weight_grads`` returns their gradients stacked for the comparison against naive.

The router's ``(T, E)`` routing map is what megatron-core hands to ``permute``; built here from
the ``(T, K)`` ids once per routing (cached: the router makes it, the dispatcher does not), the
``(T, E)`` probabilities each call from the differentiable ``(T, K)`` ones. Needs CUDA, TE and
megatron-core; ``unavailable()`` says why not.

``fp8``: a recipe name (``tensorwise``, ``delayed``, ``blockwise``): the experts run under
megatron-core's own fp8 context (``fp8_utils.get_fp8_context``: TE's autocast with the recipe
megatron-core builds from ``--fp8-format``/``--fp8-recipe``, TE's default format of the recipe:
hybrid for the tensor-scaled ones, e4m3 for blockwise), as a megatron-core fp8 run computes its
experts; TEGroupedMLP pads each expert's rows for fp8 itself.
"""

from __future__ import annotations

import torch

__all__ = ["TEGroupedExperts", "unavailable"]


def unavailable() -> str | None:
    """Why the provider cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import transformer_engine.pytorch  # noqa: F401
        from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    except Exception as exc:  # TE absent or broken: the rows are skipped with the reason
        return f"TransformerEngine does not import: {exc!r}"
    if TEColumnParallelGroupedLinear is None:
        return "megatron-core finds no TE GroupedLinear"
    return None


def _fp8_fields(fp8: str | None) -> dict:
    """The TransformerConfig fields of an fp8 recipe (``--fp8-format`` TE's default for it)."""
    if fp8 is None:
        return {}
    return {"fp8": "e4m3" if fp8 == "blockwise" else "hybrid", "fp8_recipe": fp8}


def _fp8_context(config):
    """A factory of megatron-core's fp8 autocast for ``config`` (a fresh context each call)."""
    from megatron.core.fp8_utils import get_fp8_context

    return lambda: get_fp8_context(config)


def _init_megatron() -> None:
    """One-rank NCCL world and megatron-core's parallel state (EP 1), with its RNG tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from benchmarks._dist import init_dist

    init_dist()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
        model_parallel_cuda_manual_seed(1234)


class TEGroupedExperts:
    """Callable ``(x (T, H), w13, w2, idx (T, K), probs (T, K)) -> out (T, H)``: permute ->
    TEGroupedMLP -> unpermute with the weights given at construction (``w13``/``w2`` passed to
    the call only for the provider signature: shapes are checked, values are not read)."""

    def __init__(self, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, topk: int,
                 fp8: str | None = None):  # fmt: skip
        import torch.nn.functional as F
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig

        _init_megatron()
        E, two_i, H = w13_E2IH.shape
        self.num_experts, self.topk, self.shapes = E, topk, (w13_E2IH.shape, w2_EHI.shape)
        config = TransformerConfig(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=8,
            ffn_hidden_size=two_i // 2,
            moe_ffn_hidden_size=two_i // 2,
            num_moe_experts=E,
            moe_router_topk=topk,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=True,
            moe_permute_fusion=True,
            gated_linear_unit=True,
            activation_func=F.silu,
            bias_activation_fusion=True,  # megatron-core's fused weighted SwiGLU
            add_bias_linear=False,
            gradient_accumulation_fusion=False,  # wgrad into .grad, as relaymoe's
            bf16=w13_E2IH.dtype == torch.bfloat16,
            params_dtype=w13_E2IH.dtype,
            moe_router_load_balancing_type="none",
            moe_router_pre_softmax=topk == 1,  # megatron-core asks for it at top-1
            **_fp8_fields(fp8),
        )
        build = TESpecProvider().grouped_mlp_modules(True)
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        self.experts = build(E, config, pg_collection=pgs).cuda()
        self.fc1 = [getattr(self.experts.linear_fc1, f"weight{e}") for e in range(E)]
        self.fc2 = [getattr(self.experts.linear_fc2, f"weight{e}") for e in range(E)]
        with torch.no_grad():
            for e in range(E):
                self.fc1[e].copy_(w13_E2IH[e])
                self.fc2[e].copy_(w2_EHI[e])
        self._map_key = None
        self._map = None
        self._fp8_context = _fp8_context(config) if fp8 else None

    def _routing_map(self, idx_TK: torch.Tensor) -> torch.Tensor:
        key = (idx_TK.data_ptr(), tuple(idx_TK.shape), idx_TK._version)
        if key != self._map_key:
            T = idx_TK.shape[0]
            m = torch.zeros(T, self.num_experts, dtype=torch.bool, device=idx_TK.device)
            self._map = m.scatter_(1, idx_TK.long(), True)
            self._map_key = key
        return self._map

    def __call__(self, x, w13, w2, idx, probs):
        from megatron.core.transformer.moe.moe_utils import permute, unpermute

        if (w13.shape, w2.shape) != self.shapes:
            raise ValueError(f"weights {w13.shape}, {w2.shape}; built for {self.shapes}")
        for p in (*self.fc1, *self.fc2):
            p.grad = None  # each step a first micro-batch, as the other providers' steps
        routing_map = self._routing_map(idx)
        probs_TE = torch.zeros(routing_map.shape, dtype=probs.dtype, device=probs.device)
        probs_TE = probs_TE.scatter(1, idx.long(), probs)  # differentiable in probs
        px, pprobs, order, _, _ = permute(
            x, routing_map, probs=probs_TE, num_out_tokens=x.shape[0] * self.topk, fused=True
        )
        if self._fp8_context is None:
            out, _ = self.experts(px, routing_map.sum(0), pprobs)
        else:
            with self._fp8_context():
                out, _ = self.experts(px, routing_map.sum(0), pprobs)
        return unpermute(out, order, restore_shape=x.shape, routing_map=routing_map, fused=True)

    def weight_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dw13 (E, 2I, H), dw2 (E, H, I))`` of the last backward."""
        return torch.stack([p.grad for p in self.fc1]), torch.stack([p.grad for p in self.fc2])
