"""Config-time refusal of the Megatron options the ring dispatcher cannot honour.

``check_ring_config(config)`` runs when a ``TransformerConfig`` with
``moe_token_dispatcher_type == "ring"`` is built (``register()`` hooks ``__post_init__``) and
again when a ``MoELayer`` builds its ``RingDispatcher``. It never imports Megatron: it reads
attributes, so it also works on an ``argparse.Namespace`` of Megatron arguments
(``check_ring_args``). Every refusal names the option, its value and the fix.

Why each refusal:

* expert tensor parallelism: the ring moves whole experts (``w13 (El, J, H)``); a TP-sharded
  expert would need a TP all-reduce inside every hop.
* TP > 1 without sequence parallelism: every TP rank would hold the same tokens and the ring
  would compute them TP times (Megatron itself refuses this in training).
* capacity factor / pad-to-capacity / quantization padding: the ring is dropless; it never drops
  or pads tokens, so it would silently change the model.
* ``moe_shared_expert_overlap``, ``overlap_moe_expert_parallel_comm``,
  ``overlap_dispatch_backward_with_experts_wgrad``, ``delay_wgrad_compute``: these schedule
  around an all-to-all that the ring does not have; the ring overlaps its own P2P hops.
* flex / DeepEP / HybridEP / NCCL-EP flags: those are other dispatchers.
* fp4, and fp8 primary weights (``--fp8-param-gather``): the ring's expert kernels quantise
  from the experts' own bf16 parameters. fp8 recipes are accepted: TE runs attention and the
  dense layers in fp8, and with ``--relaymoe-fp8-experts on`` the ring runs the experts' GEMMs
  in fp8 too (``fp8_experts.py``: the recipe's mapping and its own refusals); ``auto`` (the
  default) keeps them in bf16 while fp8 experts are not measured faster, ``off`` always;
  ``fp8_expert_notice`` says which GEMMs run in fp8, or why auto chose bf16, once at start.
* CUDA graphs over part of the MoE layer (``--cuda-graph-modules moe_router`` or
  ``moe_preprocess``): megatron-core then replays dispatcher state the ring does not keep. The
  whole MoE layer (``moe``, or an empty scope: the whole layer) and the whole step
  (``full_iteration``) are accepted: the ring runs captured there (``relaymoe/ring/hop_graphs.py``),
  sized by a bound no routing can exceed, so nothing is dropped. Under capture the all-to-all
  mode (sized on the host), Sinkhorn routing (its iteration count is decided on the host) and a
  start without an eager warm-up step (the ranks agree on each layer's shapes there) are refused.
* expert MLPs whose function the ring cannot name (``activation_map.py`` maps Megatron's
  ``activation_func``, ``gated_linear_unit``, clamp and offset to one ``ExpertActivation``:
  silu/gelu/gelu_tanh/relu/squared_relu/quick_gelu, gated or not, with or without biases):
  an unknown ``activation_func``, a clamp or offset Megatron's configured implementation
  ignores or applies in another order (the fused SwiGLU's clamp, SequentialMLP's fused
  quick-GeGLU clamping before the bias, TransformerEngine's activation), TEActivationOp's
  ReLU for a non-gated silu. Each message says which option and how to make it unambiguous.
* interleaved GLU weights (``moe_mlp_glu_interleave_size``): the ring reads fc1 as
  ``[gate; linear]`` halves. Latent MoE (``moe_latent_size``): the experts project to and
  from another width, which the ring's ``(E, J, H)`` / ``(E, H, I)`` experts do not.
  ``moe_apply_probs_on_input``: the ring applies the probabilities to the expert output (and
  its bias), not to the input.
* ``moe_single_grouped_weight`` / ``moe_single_grouped_bias``: one TransformerEngine
  ``GroupedTensor`` for all experts; the ring takes one parameter per expert.
* ``--relaymoe-transport copy_engine`` with an EP group across nodes of
  ``--relaymoe-gpus-per-node`` GPUs: symmetric memory needs the group on one host.

``relaymoe plan`` and ``relaymoe flags`` run ``check_ring_args`` and ``check_fused_loss_args``
on the flags they print (``relaymoe.config.megatron_namespace``), so a layout the launch
refuses is refused there too.

``fused_loss_problems`` / ``check_fused_loss_config`` / ``check_fused_loss_args`` do the same for
``--relaymoe-fused-loss`` (output layer + cross-entropy without logits), whatever the dispatcher:

* multi-token prediction: its heads compute their own logits and loss (``process_mtp_loss``),
  which the fused loss does not replace.
* MuP: it scales the logits (``mup_output_mult``) between the output layer and the loss.
* ``defer_embedding_wgrad_compute``: it keeps the logits' gradient to compute the output
  layer's weight gradient later; the fused loss never has that gradient.
* ``fp8_output_proj``: the output projection then runs in MXFP8 through TransformerEngine.
"""

from __future__ import annotations

from collections.abc import Iterable

from relaymoe.megatron.activation_map import expert_activation_problems
from relaymoe.megatron.fp8_experts import (
    auto_bf16_reason,
    fp8_expert_problems,
    fp8_experts_option,
    fp8_recipe_of,
    fp8_requested,
)

__all__ = [
    "check_ring_config",
    "check_ring_args",
    "ring_config_problems",
    "ring_graph_capture",
    "fused_loss_problems",
    "check_fused_loss_config",
    "check_fused_loss_args",
    "fp8_expert_notice",
    "launch_refusal",
]

# cuda_graph_modules of a per-layer graph: the whole MoE layer captured, or only its front
_WHOLE_MOE_SCOPES = frozenset({"moe", "full"})
_PARTIAL_MOE_SCOPES = frozenset({"moe_router", "moe_preprocess"})
# offload_modules entries that offload expert activations (the ring never materialises them)
_EXPERT_OFFLOADS = frozenset({"expert_fc1", "moe_act", "fused_group_mlp"})


def _names(value) -> list[str]:
    """cuda_graph_modules as a list of names (str, enum or a list of them)."""
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, Iterable):
        value = [value]
    return [getattr(v, "name", str(v)) for v in value]


def _graph_impl(g) -> str:
    """The CUDA-graph implementation, the deprecated switches mapped as Megatron maps them."""
    impl = g("cuda_graph_impl", "none") or "none"
    if g("enable_cuda_graph", False):
        impl = "local" if impl == "none" else impl
    if g("external_cuda_graph", False):
        impl = "transformer_engine" if impl == "none" else impl
    return impl


def ring_graph_capture(c) -> str | None:
    """How CUDA graphs hold the ring's MoE layer under config or arguments ``c``:
    ``"whole_step"`` (``--cuda-graph-impl full_iteration``), ``"per_layer"`` (a per-layer graph
    of ``local`` or ``transformer_engine`` over the whole MoE layer: ``--cuda-graph-modules moe``,
    or no modules, which captures the whole layer), or None (the MoE layer runs eagerly).
    The dispatcher runs ``ring_moe(capturable=True)`` whenever this is not None."""
    g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    impl = _graph_impl(g)
    if impl == "full_iteration":
        return "whole_step"
    if impl in ("local", "transformer_engine"):
        modules = _names(g("cuda_graph_modules", None)) or ["full"]
        if any(m in _WHOLE_MOE_SCOPES for m in modules):
            return "per_layer"
    return None


def _graph_problems(c) -> list[str]:
    """The CUDA-graph settings of config or arguments ``c`` the ring cannot run captured."""
    g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    impl = _graph_impl(g)
    modules = _names(g("cuda_graph_modules", None)) or ["full"]
    partial = [m for m in modules if m in _PARTIAL_MOE_SCOPES]
    if impl in ("local", "transformer_engine") and partial and "moe" not in modules:
        return [
            f"per-layer CUDA graphs over part of the MoE layer (cuda_graph_impl={impl!r}, "
            f"cuda_graph_modules={modules}): megatron-core then replays its dispatcher's state "
            f"around the graph, which the ring does not keep; fix: capture the whole MoE layer "
            f"(--cuda-graph-modules attn moe) or the whole step (--cuda-graph-impl "
            f"full_iteration): the ring runs captured in both, dropless"
        ]
    scope = ring_graph_capture(c)
    if scope is None:
        return []
    where = (f"--cuda-graph-impl {impl}" if scope == "whole_step" else
             f"--cuda-graph-impl {impl} --cuda-graph-modules {' '.join(modules)}")  # fmt: skip
    problems = []
    if scope == "per_layer" and impl == "local":
        problems.append(
            f"{where}: megatron-core's local per-layer graphs over the ring's MoE layer train "
            f"differently from the same run eager, from the first graphed step on (measured on "
            f"an H100; cause not found), while transformer_engine's per-layer graphs and "
            f"full_iteration match the eager run bitwise; fix: --cuda-graph-impl "
            f"transformer_engine --cuda-graph-modules attn moe, or --cuda-graph-impl "
            f"full_iteration"
        )
    if g("relaymoe_mode") == "alltoall":
        problems.append(
            f"--relaymoe-mode alltoall with {where}: the all-to-all mode sizes its messages on "
            f"the host, which a captured graph cannot replay; fix: --relaymoe-mode auto (it then "
            f"picks among the ring modes), expert or token"
        )
    warm_up = g("cuda_graph_warmup_steps", 1)
    if warm_up is not None and warm_up < 1:
        problems.append(
            f"cuda_graph_warmup_steps={warm_up} with {where}: the ring's ranks agree on each "
            f"layer's shapes in an eager step before the capture; fix: "
            f"--cuda-graph-warmup-steps 1 or more"
        )
    balancing = g("moe_router_load_balancing_type", None)
    balancing = balancing if isinstance(balancing, list | tuple) else [balancing]
    if "sinkhorn" in balancing:
        problems.append(
            f"moe_router_load_balancing_type='sinkhorn' with {where}: Sinkhorn routing iterates "
            f"until a tolerance read on the host, which a captured graph cannot replay; fix: "
            f"aux_loss, seq_aux_loss, global_aux_loss or none, or run without CUDA graphs over "
            f"the MoE layer"
        )
    return problems


def ring_config_problems(c, *, ep_size: int | None = None, args_style: bool = False) -> list[str]:
    """All reasons the ring cannot run config ``c`` (empty when it can).

    ``args_style``: ``c`` is Megatron's parsed arguments (the experts' activation then comes
    from ``--swiglu``/``--squared-relu``/``--quick-geglu`` as Megatron translates them); the
    fixes are command-line flags either way.
    """
    g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    problems: list[str] = []

    def flag(field: str) -> str:
        return "--" + field.replace("_", "-")

    def refuse_set(field: str, why: str, unset=None) -> None:
        """Refuse ``field`` when it is set (``unset=None``: not None; ``unset=False``: truthy,
        shown as True); ``why`` follows ``field=value``, the fix is removing its flag."""
        value = g(field, unset)
        if value is not None if unset is None else value:
            shown = value if unset is None else True
            problems.append(f"{field}={shown}{why}; fix: remove {flag(field)}")

    tp = g("tensor_model_parallel_size", 1) or 1
    etp = g("expert_tensor_parallel_size", None)
    etp = tp if etp is None else etp
    if etp > 1:
        inherited = " inherited from TP" if g("expert_tensor_parallel_size") is None else ""
        problems.append(
            f"expert tensor parallelism is not supported with the ring dispatcher "
            f"(expert_tensor_parallel_size={etp}{inherited}); "
            f"fix: pass --expert-tensor-parallel-size 1 (experts are split over EP only, "
            f"TP still applies to attention)"
        )
    if tp > 1 and not g("sequence_parallel", False):
        problems.append(
            f"tensor_model_parallel_size={tp} without sequence parallelism: every TP rank would "
            f"hold the same tokens; fix: add --sequence-parallel"
        )
    refuse_set("moe_expert_capacity_factor", ": the ring is dropless (never drops or pads tokens)")
    refuse_set("moe_pad_expert_input_to_capacity", ": the ring is dropless", unset=False)
    for field in ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8"):
        refuse_set(field, ": the ring pads nothing for quantization", unset=False)
    refuse_set(
        "moe_shared_expert_overlap",
        " overlaps shared experts with an all-to-all the ring does not have (shared experts run "
        "outside the ring)",
        unset=False,
    )
    for field in (
        "overlap_moe_expert_parallel_comm",
        "overlap_dispatch_backward_with_experts_wgrad",
        "delay_wgrad_compute",
    ):
        refuse_set(
            field,
            " schedules around the all-to-all dispatcher; the ring overlaps its own P2P hops",
            unset=False,
        )
    refuse_set("moe_enable_deepep", " selects DeepEP (a flex-dispatcher backend)", unset=False)
    for field in (
        "moe_flex_dispatcher_num_sms",
        "moe_deepep_num_sms",
        "moe_hybridep_num_sms",
        "moe_hybridep_num_blocks_permute",
        "moe_hybridep_num_blocks_unpermute",
    ):
        refuse_set(field, " is a flex/DeepEP/HybridEP setting")
    for field in ("moe_ncclep_static_shape", "moe_ncclep_zero_copy"):
        refuse_set(field, " is an NCCL-EP (flex) setting", unset=False)
    if g("fp4") not in (None, False):
        problems.append(
            f"fp4={g('fp4')!r}: the ring runs its experts in bf16 and supports fp8 recipes only "
            f"for the layers TransformerEngine runs; fix: remove --fp4-format (or use "
            f"--fp8-format with --bf16)"
        )
    if g("fp8") not in (None, False):
        param_gather = g("fp8_param_gather", False) or g("fp8_param", False)
        if param_gather:
            problems.append(
                "fp8 primary weights (--fp8-param-gather) would hold the experts' weights as fp8 "
                "tensors, which the ring's bf16 expert kernels do not read; fix: remove "
                "--fp8-param-gather (attention and dense layers still compute in fp8)"
            )
    problems += _graph_problems(c)
    problems += fp8_expert_problems(c, graph_capture=ring_graph_capture(c) is not None)
    if g("transformer_impl") == "inference_optimized":
        problems.append(
            "transformer_impl='inference_optimized' uses its own inference dispatcher; "
            "fix: use --transformer-impl transformer_engine or local for training"
        )
    num_experts = g("num_moe_experts", None)
    if num_experts is None:
        num_experts = g("num_experts", None)
    ep = ep_size if ep_size is not None else g("expert_model_parallel_size", 1) or 1
    if num_experts is not None and num_experts % ep != 0:
        problems.append(
            f"num_moe_experts={num_experts} is not divisible by the expert-parallel size {ep}; "
            f"fix: choose --expert-model-parallel-size dividing {num_experts}"
        )
    # --relaymoe-transport copy_engine across nodes: the copy engine's symmetric memory needs
    # the whole EP group on one host (the ring refuses it at its first call; the cluster shape
    # is known here only from --relaymoe-gpus-per-node). Megatron's EP group is ep*etp
    # consecutive ranks, so it lies in one node iff that block divides the node's GPUs.
    gpn, block = g("relaymoe_gpus_per_node", None), ep * etp
    if g("relaymoe_transport") == "copy_engine" and gpn and (block > gpn or gpn % block):
        problems.append(
            f"relaymoe_transport='copy_engine' needs each EP group on one node (symmetric "
            f"memory), but an EP group of {ep} ranks ({block} consecutive ranks) spans nodes of "
            f"relaymoe_gpus_per_node={gpn} GPUs; fix: pass --relaymoe-transport nccl (or auto, "
            f"which picks NCCL across nodes)"
        )
    # The experts' function: read from the options (activation_map.py), refused by name where
    # it cannot be mapped. Biases are the experts' own parameters (expert_weights.py).
    problems += expert_activation_problems(c, args_style=args_style)[1]
    refuse_set(
        "moe_mlp_glu_interleave_size", ": the ring reads a gated fc1 as [gate; linear] halves"
    )
    for field in ("moe_single_grouped_weight", "moe_single_grouped_bias"):
        refuse_set(
            field,
            " holds the experts as one TransformerEngine GroupedTensor; the ring reads one "
            "parameter per expert (TEGroupedMLP's weight{j}/bias{j}, SequentialMLP's experts)",
            unset=False,
        )
    refuse_set("moe_latent_size", " (latent MoE) is not supported by the ring")
    refuse_set(
        "moe_apply_probs_on_input",
        ": the ring applies probabilities to the expert output",
        unset=False,
    )
    offload = set(g("offload_modules", None) or [])
    if g("fine_grained_activation_offloading", False) and offload & _EXPERT_OFFLOADS:
        problems.append(
            f"offload_modules={sorted(offload)} offloads expert activations the ring never "
            f"materialises (it recomputes per hop); fix: drop expert_fc1/moe_act/"
            f"fused_group_mlp from --offload-modules"
        )
    return problems


def fp8_expert_notice(c) -> str | None:
    """The one line a ring run under an fp8 recipe prints at start (None without fp8): which
    layers compute in fp8, which of the ring's expert GEMMs do, and, where
    ``--relaymoe-fp8-experts auto`` keeps the experts in bf16, why (the measured rows) and what
    ``on`` would run."""
    fmt = getattr(c, "fp8", None)
    if fmt in (None, False) or getattr(c, "moe_token_dispatcher_type", None) != "ring":
        return None
    recipe = getattr(c, "fp8_recipe", None)
    recipe = getattr(recipe, "value", recipe)
    head = (f"[relaymoe] fp8 format {fmt}, recipe {recipe}: attention and dense layers compute "
            f"in fp8 through TransformerEngine; ")  # fmt: skip
    option = fp8_experts_option(c)
    if fp8_requested(c, option):
        return head + (
            f"the ring's routed experts run {_expert_gemms(fp8_recipe_of(c, option))} "
            f"(--relaymoe-fp8-experts {option}); their fp8 weight copies travel the ring "
            "(--relaymoe-fp8-experts off: bf16)"
        )
    if option == "off":
        return head + "the ring's routed experts compute in bf16 (--relaymoe-fp8-experts off)"
    try:
        would = f"their {_expert_gemms(fp8_recipe_of(c, 'on'))}"
    except ValueError:  # a recipe the fp8 experts do not implement
        would = "nothing in fp8 with this recipe: it is refused by name"
    return head + (
        f"the ring's routed experts compute in bf16: --relaymoe-fp8-experts auto keeps them "
        f"there, since {auto_bf16_reason(recipe or 'delayed')}; --relaymoe-fp8-experts on runs "
        f"{would}"
    )


def _expert_gemms(experts) -> str:
    """Which GEMMs an ``Fp8Recipe`` runs in fp8 (and which in bf16), with its formats."""
    gemms = experts.gemms_in_fp8()
    in_fp8 = [g for g in ("fprop", "dgrad", "wgrad") if gemms[g]]
    in_bf16 = [g for g in ("fprop", "dgrad", "wgrad") if not gemms[g]]
    bf16 = f" and {'/'.join(in_bf16)} in bf16" if in_bf16 else ""
    return (f"{'/'.join(in_fp8)} in fp8 ({experts.recipe}, {experts.fmt}; gradients "
            f"{experts.grad_format}){bf16}")  # fmt: skip


def _raise(feature: str, problems: list[str], what: str) -> None:
    """One ``ValueError`` listing every problem, when there are any."""
    if problems:
        raise ValueError(f"{feature} cannot run {what}:\n  - " + "\n  - ".join(problems))


def check_ring_config(config, *, ep_size: int | None = None) -> None:
    """Raise ``ValueError`` listing every unsupported option of a ring ``TransformerConfig``."""
    _raise(
        "--moe-token-dispatcher-type ring",
        ring_config_problems(config, ep_size=ep_size),
        "this configuration",
    )


def check_ring_args(args) -> None:
    """The same checks on Megatron's parsed arguments (before any model is built)."""
    if getattr(args, "moe_token_dispatcher_type", None) != "ring":
        return
    _raise(
        "--moe-token-dispatcher-type ring",
        ring_config_problems(args, args_style=True),
        "these arguments",
    )


# ------------------------------------------------------------------------------ fused loss
def fused_loss_problems(c) -> list[str]:
    """All reasons ``--relaymoe-fused-loss`` cannot run config or arguments ``c`` (the fields
    read have the same names in both)."""
    g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    problems: list[str] = []
    if g("mtp_num_layers"):
        problems.append(
            f"mtp_num_layers={g('mtp_num_layers')}: the multi-token-prediction heads compute "
            f"their own logits and loss, which the fused loss does not replace; fix: remove "
            f"--mtp-num-layers, or remove --relaymoe-fused-loss"
        )
    if g("use_mup", False):
        problems.append(
            "use_mup=True scales the logits (mup_output_mult) between the output layer and the "
            "loss; fix: remove --use-mup, or remove --relaymoe-fused-loss"
        )
    if g("defer_embedding_wgrad_compute", False):
        problems.append(
            "defer_embedding_wgrad_compute=True computes the output layer's weight gradient "
            "later from the logits' gradient, which the fused loss never materialises; fix: "
            "remove --defer-embedding-wgrad-compute, or remove --relaymoe-fused-loss"
        )
    if g("fp8_output_proj", False):
        problems.append(
            "fp8_output_proj=True runs the output projection in MXFP8 through "
            "TransformerEngine; fix: remove --fp8-output-proj, or remove --relaymoe-fused-loss"
        )
    return problems


def check_fused_loss_config(config) -> None:
    """Raise ``ValueError`` listing every option of ``config`` the fused loss cannot honour."""
    _raise("--relaymoe-fused-loss", fused_loss_problems(config), "this configuration")


def check_fused_loss_args(args) -> None:
    """The same checks on Megatron's parsed arguments, when ``--relaymoe-fused-loss`` is set."""
    if getattr(args, "relaymoe_fused_loss", False):
        _raise("--relaymoe-fused-loss", fused_loss_problems(args), "these arguments")


# ------------------------------------------------------------------------------ one line
def launch_refusal(args) -> str | None:
    """What the launch refuses in Megatron's parsed ``args`` (``check_ring_args``, then
    ``check_fused_loss_args``: what ``register()``'s patched ``validate_args`` runs), as one
    line with every reason and its fix; None when it accepts them. ``relaymoe plan``/``flags``
    and train.sh's preflight report it so, before anything is launched."""
    try:
        check_ring_args(args)
        check_fused_loss_args(args)
    except ValueError as e:
        head, *problems = str(e).splitlines()
        return f"{head.rstrip(':')} (the launch refuses it): " + "; ".join(
            p.strip().removeprefix("- ") for p in problems
        )
    return None
