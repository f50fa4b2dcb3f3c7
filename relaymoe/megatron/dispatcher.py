"""``RingDispatcher``: Megatron's token-dispatcher slot, filled by the ring.

How it plugs into megatron-core 0.19's ``MoELayer.forward`` (route -> preprocess -> dispatch ->
routed_experts_compute -> combine -> postprocess):

* ``dispatch_preprocess`` flattens ``[S/TP, B, H]`` to ``x (T, H)`` and turns the router's
  ``(T, E)`` ``routing_map``/``probs`` into ``topk_idx (T, K)`` (global expert ids) and
  ``topk_probs (T, K)`` (differentiable into the router's probs);
* ``token_dispatch``/``token_combine``/``combine_preprocess`` are identities: tokens stay on
  their rank, nothing is gathered (with expert-TP 1 and sequence parallelism every rank of the
  EP group already holds distinct tokens, which is exactly what the allgather dispatcher's
  TPxEP all-gather would collect);
* ``MoELayer.routed_experts_compute`` (wrapped by ``register()``) calls
  ``compute_experts(experts, x, topk_probs)``: the ring over ``pg_collection.ep`` with the
  experts module's own parameters passed as per-expert lists (``ring_moe``'s list form: no
  stacked copy of the experts is kept from forward to backward; ``expert_weights.py``), their
  biases likewise, and the activation the config names (``activation_map.py``, read once at
  build). With ``gradient_accumulation_fusion`` and DDP's ``main_grad`` on the expert weights
  (read at each call: DDP wraps the model after it is built), the ring adds their gradients
  into ``main_grad`` itself and hands autograd Megatron's dummies (``main_grad.py``). The
  ring's output holds the fc2 bias scaled by the probabilities, as Megatron's experts' output
  does, and the wrapper returns no separate bias: Megatron adds none again;
* ``combine_postprocess`` restores ``[S/TP, B, H]``; ``MoELayer.postprocess`` then adds the
  shared experts' output, computed outside the ring as usual.

Each dispatcher holds its configuration and its state, as Megatron's own dispatchers hold
``config`` and ``pg_collection``: ``ring_config`` (a ``relaymoe.options.RingConfig``, read once
at build: ``settings.ring_config_of``; its calls pass ``call_config``, the same with
``gpus_per_node`` counted in EP ranks) and ``runtime`` (a ``relaymoe.ring.RingRuntime`` over the
EP group, kept for the dispatcher's lifetime: the agreements of its calls, the copy engines'
workspace, its recorded hops, its lag watch). Building a layer changes no process state, and two
layers (or two models) with different options in one process each run with their own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from torch import Tensor

from relaymoe.activation import SWIGLU
from relaymoe.megatron.activation_map import expert_activation_of
from relaymoe.megatron.expert_weights import expert_bias_lists, expert_param_lists
from relaymoe.megatron.fp8_experts import layer_fp8_state
from relaymoe.megatron.main_grad import fused_main_grads
from relaymoe.megatron.settings import ring_config_of
from relaymoe.megatron.validate import check_ring_config, ring_graph_capture
from relaymoe.options import RingConfig
from relaymoe.ring import RingRuntime, ring_moe

__all__ = [
    "RingDispatcher",
    "ep_ranks_per_node",
    "ModelRuntimes",
    "model_runtime",
    "routing_map_to_topk",
]


def ep_ranks_per_node(global_ranks: list[int], gpus_per_node: int | None) -> int | None:
    """EP ranks per node for the two-level ring, from the EP group's global ranks and the
    cluster's GPUs per node (``--relaymoe-gpus-per-node``; node = global rank // GPUs per node,
    torchrun's node-major numbering). None when not given: the ring reads the ranks' hosts."""
    if gpus_per_node is None:
        return None
    from relaymoe.ring.plan import nodes_from_hosts

    per_node = nodes_from_hosts([r // gpus_per_node for r in global_ranks])
    if per_node is None:
        raise ValueError(
            f"--relaymoe-gpus-per-node {gpus_per_node}: the EP group's global ranks "
            f"{list(global_ranks)} do not form equal blocks of consecutive ranks per node, which "
            "the two-level ring needs; fix: choose parallel sizes whose EP groups are whole "
            "nodes (or fit in one), or leave the flag unset (the flat ring then runs)"
        )
    return per_node


def routing_map_to_topk(routing_map: Tensor, probs: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """``(T, E)`` bool map + ``(T, E)`` probs -> ``topk_idx (T, K)`` int64, ``topk_probs (T, K)``.

    Megatron's routers select exactly ``K`` experts per token (capacity dropping is refused), so
    ``topk`` of the map recovers them. A row with fewer than ``K`` selections (e.g. a future
    router masking padding) gets extra pairs with probability exactly 0 and no gradient, which
    contribute nothing. ``topk_probs`` is differentiable into ``probs``.
    """
    if routing_map.shape != probs.shape or routing_map.dim() != 2:
        raise ValueError(
            f"routing_map {tuple(routing_map.shape)} and probs {tuple(probs.shape)} must both "
            f"be (T, E)"
        )
    num_experts = routing_map.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"moe_router_topk={topk} must be in [1, num_moe_experts={num_experts}]")
    with torch.no_grad():
        idx = torch.topk(routing_map.to(torch.int8), topk, dim=1, sorted=False).indices
        selected = routing_map.gather(1, idx)
    topk_probs = torch.where(selected, probs.gather(1, idx), probs.new_zeros(()))
    return idx, topk_probs


# the attribute of a TransformerConfig holding its model's runtimes (model_runtime)
CONFIG_RUNTIMES = "relaymoe_runtimes"


class ModelRuntimes(dict):
    """The runtimes of one model by (EP group, ring config), held on its ``TransformerConfig``.
    A copy of the config (Megatron deep-copies configs for some submodules) shares them: they
    are the model's, and streams and symmetric memory cannot be copied; a pickled config
    carries none (runtimes are made again on first use)."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (ModelRuntimes, ())


def model_runtime(config, group, ring_config: RingConfig) -> RingRuntime:
    """The ``RingRuntime`` every ring layer of one model shares: one per (EP group, ring config),
    held on the model's ``TransformerConfig`` (which every layer of the model holds), made on
    first use. Shared because what it keeps is the model's, not a layer's: the copy-engine
    workspace is sized by the largest layer's pass (one per layer would hold L of them), and the
    layers' equal shapes need one agreement. Another model (another config object) or other ring
    options get their own."""
    runtimes = getattr(config, CONFIG_RUNTIMES, None)
    if runtimes is None:
        runtimes = ModelRuntimes()
        setattr(config, CONFIG_RUNTIMES, runtimes)
    key = (getattr(group, "group_name", None) or id(group), ring_config)
    if key not in runtimes:
        runtimes[key] = RingRuntime(group)
    return runtimes[key]


class RingDispatcher(MoETokenDispatcher):
    """Token dispatcher for ``moe_token_dispatcher_type == "ring"`` (built by ``register()``).

    ``ring_config``: the ring's options (default: ``settings.ring_config_of(config)``, the
    object attached to the ``TransformerConfig`` or built from Megatron's arguments, else
    ``RingConfig()``). ``runtime``: what its calls keep (default: the ``RingRuntime`` of the
    model: one per EP group and ring config, shared by every dispatcher built from the same
    ``TransformerConfig``, as the layers share their copy-engine workspace, the agreements of
    equal shapes and the communication stream; ``model_runtime``)."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config,
        pg_collection=None,
        ring_config: RingConfig | None = None,
        runtime: RingRuntime | None = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        check_ring_config(config, ep_size=self.ep_size)
        if self.tp_size != 1:
            raise ValueError(
                f"expert tensor parallel group of size {self.tp_size}: the ring needs "
                f"--expert-tensor-parallel-size 1"
            )
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        expected = list(
            range(self.ep_rank * num_local_experts, (self.ep_rank + 1) * num_local_experts)
        )
        if self.local_expert_indices != expected:
            raise ValueError(
                f"local experts {self.local_expert_indices} of EP rank {self.ep_rank} are not "
                f"the contiguous block {expected} the ring assumes"
            )
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.activation = expert_activation_of(config)  # what Megatron's experts would compute
        # megatron-core captures the whole step, or each layer's MoE, in a CUDA graph: every
        # call runs the ring's capturable path, the eager warm-up steps too
        # (relaymoe/ring/hop_graphs.py), so eager and replayed steps compute alike
        self.capturable = ring_graph_capture(config) is not None
        self.ring_config = ring_config if ring_config is not None else ring_config_of(config)
        if not isinstance(self.ring_config, RingConfig):
            raise ValueError(
                f"RingDispatcher: ring_config={self.ring_config!r} must be a "
                "relaymoe.options.RingConfig (relaymoe.megatron.configure(config, ring=...))"
            )
        group = self.ep_group if dist.is_initialized() else None
        self.runtime = (
            runtime if runtime is not None else model_runtime(config, group, self.ring_config)
        )
        ranks = dist.get_process_group_ranks(self.ep_group) if dist.is_initialized() else [0]
        self.ep_per_node = ep_ranks_per_node(ranks, self.ring_config.gpus_per_node)
        # what its ring calls run with: the configured options, with gpus_per_node the EP
        # group's ranks per node (the configured value counts the cluster's GPUs per node)
        self.call_config = self.ring_config
        if self.ep_per_node != self.ring_config.gpus_per_node:
            self.call_config = self.ring_config.replace(gpus_per_node=self.ep_per_node)
        # the layer's fp8 state (None: bf16 experts), this layer's as its weights are: the
        # recipe, delayed scaling's histories, the experts' fp8 copy (fp8_experts.py)
        self.fp8 = layer_fp8_state(config, self.ring_config.fp8_experts)
        self.hidden_shape = None
        self.topk_idx = None

    # ---- dispatch: tokens stay where they are -------------------------------------------
    def dispatch_preprocess(self, tokens: Tensor, routing_map: Tensor, probs: Tensor):
        self.hidden_shape = tokens.shape
        x_TH = tokens.reshape(-1, tokens.shape[-1])
        self.topk_idx, probs_TK = routing_map_to_topk(
            routing_map.reshape(-1, routing_map.shape[-1]),
            probs.reshape(-1, probs.shape[-1]),
            self.topk,
        )
        return x_TH, probs_TK

    def token_dispatch(self, hidden_states: Tensor, probs: Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor):
        raise NotImplementedError(
            "RingDispatcher has no permuted-token stage: the ring runs the experts itself via "
            "compute_experts(); MoELayer.routed_experts_compute is redirected by "
            "relaymoe.megatron.register() (call it before building the model)"
        )

    # ---- the experts: one ring call ------------------------------------------------------
    def compute_experts(self, experts, x_TH: Tensor, probs_TK: Tensor) -> Tensor:
        """Routed-expert output ``(T, H)`` for this rank's tokens, via the ring."""
        if self.topk_idx is None:
            raise RuntimeError("compute_experts called before dispatch_preprocess")
        idx_TK, self.topk_idx = self.topk_idx, None
        fc1, fc2 = expert_param_lists(experts)  # the parameters themselves, no copy
        b13, b2 = expert_bias_lists(experts)
        if fc1[0].dtype != x_TH.dtype:
            raise ValueError(
                f"expert weights are {fc1[0].dtype} but the MoE input is {x_TH.dtype}; the ring "
                f"needs one dtype (train with --bf16 so both are bf16)"
            )
        return ring_moe(
            x_TH,
            fc1,
            fc2,
            idx_TK,
            probs_TK,
            group=self.runtime.group,
            config=self.call_config,
            runtime=self.runtime,
            trusted=True,  # ids from Megatron's router; every EP rank runs the same shapes
            capturable=self.capturable,
            # gradient_accumulation_fusion under DDP: the weight gradients go into main_grad
            # (the fp8 ring returns them to autograd, which DDP's hooks add into main_grad)
            main_grads=None if self.fp8 is not None else fused_main_grads(self.config, fc1, fc2),
            **self._expert_mlp(b13, b2),
            **({"fp8": self.fp8} if self.fp8 is not None else {}),
        )

    def _expert_mlp(self, b13, b2) -> dict:
        """``ring_moe``'s ``activation``/``b13``/``b2`` keywords, each only where it differs from
        ``ring_moe``'s default (bias-free SwiGLU)."""
        kw = {} if self.activation == SWIGLU else {"activation": self.activation}
        if b13 is not None:
            kw["b13"] = b13
        if b2 is not None:
            kw["b2"] = b2
        return kw

    # ---- combine: nothing to move back ----------------------------------------------------
    def combine_preprocess(self, hidden_states: Tensor):
        return hidden_states

    def token_combine(self, hidden_states: Tensor):
        return hidden_states

    def combine_postprocess(self, hidden_states: Tensor):
        return hidden_states.view(self.hidden_shape)
