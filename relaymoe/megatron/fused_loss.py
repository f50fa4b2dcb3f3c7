"""``--relaymoe-fused-loss``: GPTModel's output layer + cross-entropy without the logits.

With the flag, a ``GPTModel`` built after ``register()`` computes its language-model loss
through ``relaymoe.linear_cross_entropy`` whenever it is given labels outside inference: no
``(tokens, V/TP)`` logits tensor exists. Labels ``None`` (logits wanted), inference, a caller's
own ``output_processor`` and gathered logits at TP > 1 take Megatron's path untouched.

It plugs into Megatron's own hook: ``GPTModel._postprocess`` calls an ``output_processor``
after the MTP block with the final hidden states, the output layer and the tied output weight;
the patch (``relaymoe/megatron/patches.py``) passes ``fused_output_processor`` there.

``output_layer_loss`` reproduces ``ColumnParallelLinear`` + ``compute_language_model_loss``:

* the weight is the output layer's, or with tied embeddings the embedding's (Megatron hands it
  over as ``output_weight``), so its gradient reaches the embedding as in Megatron;
* the input mapping is the layer's: with sequence parallelism the hidden states are gathered
  over TP and their gradient reduce-scattered back; at TP > 1 without it, the gradient is
  all-reduced (each rank's vocabulary shard contributes a part of it);
* with ``gradient_accumulation_fusion`` the weight gradient is added to ``weight.main_grad``
  and the parameter marked ``grad_added_to_main_grad`` with the dummy gradient Megatron's linear
  returns; without it the gradient is a plain ``.grad`` for Megatron's DDP to pick up;
* where ``loss_mask == 0`` a copy of the labels gets ``IGNORE_INDEX``: the loss there is 0 (the
  loss function multiplies it by 0 anyway), and the upstream gradient Megatron's loss function
  gives is then a constant on every other token, the case the fused backward is fast for;
* the result is the per-token fp32 loss ``[b, s]``, as ``compute_language_model_loss``
  returns it. No label smoothing: megatron-core 0.19's ``compute_language_model_loss`` applies
  none (``output_layer_loss`` takes one for callers that do).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("relaymoe.megatron")

__all__ = ["IGNORE_INDEX", "output_layer_loss", "fused_output_processor", "install"]

IGNORE_INDEX = -100
ATTR = "_relaymoe_fused_loss"  # on a GPTModel: its output processor, set by install()


def _linear_cross_entropy():
    # looked up at call time (relaymoe.loss imports torch kernels lazily; tests patch it there)
    import relaymoe.loss

    return relaymoe.loss.linear_cross_entropy


_LOGGED: set[str] = set()


def _log_once(key: str, message: str) -> None:
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    logger.info(message)
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[relaymoe] {message}", flush=True)


class _IntoMainGrad(torch.autograd.Function):
    """Identity on the weight; backward adds the weight's gradient to ``main_grad`` and returns
    what Megatron's linear returns under ``gradient_accumulation_fusion``."""

    @staticmethod
    def forward(ctx, weight_VH):
        ctx.weight = weight_VH  # the parameter itself: main_grad and the marks live on it
        return weight_VH.view_as(weight_VH)

    @staticmethod
    def backward(ctx, grad_VH):
        weight = ctx.weight
        if hasattr(weight, "__fsdp_param__"):  # Megatron-FSDP: its buffer takes the gradient
            weight.main_grad = weight.get_main_grad()
            weight.main_grad.copy_(grad_VH)
        else:
            weight.main_grad.add_(grad_VH)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        # Megatron's DDP hooks run on the main thread only when a gradient arrives: hand them a
        # dummy, and the mark that tells them it is already in main_grad.
        weight.grad_added_to_main_grad = True
        from megatron.core.tensor_parallel import layers

        zero = getattr(weight, "zero_out_wgrad", False)
        shape = list(weight.main_grad.shape)
        if getattr(layers, "HAVE_TE", False):
            if zero:
                return layers.get_dummy_wgrad(shape, grad_VH.dtype, zero=True)
            return layers.get_dummy_wgrad(shape, grad_VH.dtype)
        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=grad_VH.dtype, device=weight.main_grad.device)


def output_layer_loss(
    output_layer,
    hidden_SBH: torch.Tensor,
    labels_BS: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    loss_mask_BS: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Megatron's ``output_layer`` (a ``ColumnParallelLinear``) followed by its vocab-parallel
    cross-entropy, fused. Returns ``loss_BS`` float32.

    ``hidden_SBH``: the final hidden states ``(S/TP if sequence parallel else S, B, H)``;
    ``labels_BS`` and ``loss_mask_BS``: ``(B, S)``; ``weight``: ``(V/TP, H)``, the layer's own
    when ``None``. Suffixes: S sequence, B micro-batch, H hidden, V vocabulary, T = S*B tokens.
    """
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )
    from megatron.core.utils import get_pg_size

    if weight is None:
        weight = output_layer.weight
    expected = (output_layer.output_size_per_partition, output_layer.input_size)
    if tuple(weight.shape) != expected:
        raise RuntimeError(
            f"supplied weight's shape is {tuple(weight.shape)}, not {expected} as expected"
        )
    group = output_layer.tp_group
    tp = get_pg_size(group)
    if output_layer.sequence_parallel:
        hidden_SBH = gather_from_sequence_parallel_region(
            hidden_SBH, tensor_parallel_output_grad=True, group=group
        )
    elif tp > 1:
        hidden_SBH = copy_to_tensor_model_parallel_region(hidden_SBH, group=group)
    s, b, h = hidden_SBH.shape
    if tuple(labels_BS.shape) != (b, s):
        raise ValueError(
            f"labels of shape {tuple(labels_BS.shape)} do not match the hidden states "
            f"(sequence {s}, micro-batch {b}): expected ({b}, {s})"
        )
    labels_SB = labels_BS.t()
    if loss_mask_BS is not None:
        labels_SB = labels_SB.masked_fill(loss_mask_BS.t() == 0, IGNORE_INDEX)  # a copy
    if weight.requires_grad and output_layer.gradient_accumulation_fusion:
        weight = _IntoMainGrad.apply(weight)
    loss_T = _linear_cross_entropy()(
        hidden_SBH.reshape(s * b, h),
        weight,
        labels_SB.reshape(s * b),
        tp_group=group if tp > 1 else None,
        chunk_tokens=chunk_tokens,
        ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing,
        # Megatron's data pipeline made these labels (as its router made the ring's ids): no
        # host sync to check their range; an out-of-range label gets Megatron's own behaviour
        # (no target logit on any shard)
        validate=False,
    )
    return loss_T.view(s, b).t().contiguous()


def fused_output_processor(
    *, hidden_states, output_layer, output_weight, labels, loss_mask, chunk_tokens=None, **_
):
    """An ``output_processor`` for ``GPTModel._postprocess`` (keyword arguments as it passes
    them): the loss ``(B, S)`` fp32 from the final hidden states and the labels."""
    return output_layer_loss(
        output_layer,
        hidden_states,
        labels,
        weight=output_weight,
        loss_mask_BS=loss_mask,
        chunk_tokens=chunk_tokens,
    )


def takes_fused_path(model, arguments: dict) -> bool:
    """Whether ``GPTModel._postprocess`` called with ``arguments`` (by name) computes the loss
    fused; otherwise Megatron's own path runs."""
    if arguments.get("labels") is None or arguments.get("inference_context") is not None:
        return False
    from megatron.core.inference.utils import InferenceMode

    if InferenceMode.is_active():
        return False
    if arguments.get("output_processor") is not None:
        _log_once(
            "caller-processor",
            "--relaymoe-fused-loss: the caller passed its own output_processor; that one runs "
            "(Megatron's path), not the fused loss",
        )
        return False
    gather = arguments.get("runtime_gather_output")
    layer = model.output_layer
    if layer.gather_output if gather is None else gather:
        from megatron.core.utils import get_pg_size

        # Megatron computes the loss on gathered logits; nothing to fuse at TP > 1
        return get_pg_size(layer.tp_group) == 1
    return True


def _output_layer_problems(model) -> list[str]:
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import ColumnParallelLinear

    problems = []
    if type(model).compute_language_model_loss is not LanguageModule.compute_language_model_loss:
        problems.append(
            f"{type(model).__name__} overrides compute_language_model_loss, which the fused "
            f"loss would bypass; fix: remove --relaymoe-fused-loss for this model"
        )
    layer = model.output_layer
    if not isinstance(layer, ColumnParallelLinear):
        problems.append(
            f"the output layer is a {type(layer).__name__}, not Megatron's "
            f"ColumnParallelLinear; fix: remove --fp8-output-proj, or remove "
            f"--relaymoe-fused-loss"
        )
        return problems
    if layer.bias is not None and not layer.skip_bias_add:
        problems.append(
            "the output layer has a bias, which relaymoe.linear_cross_entropy does not add; "
            "fix: build the output layer without bias (GPTModel's default), or remove "
            "--relaymoe-fused-loss"
        )
    if getattr(layer, "gtp_remat_size", 1) > 1:
        problems.append(
            f"the output layer's weight is re-materialised over a GTP group of "
            f"{layer.gtp_remat_size} ranks, which the fused loss does not gather; fix: disable "
            f"GTP re-materialisation, or remove --relaymoe-fused-loss"
        )
    return problems


def install(model, *, chunk_tokens: int | None = None) -> None:
    """Enable the fused loss on ``model``, a ``GPTModel`` just built; raise ``ValueError``
    naming every option it cannot honour."""
    from relaymoe.megatron.validate import fused_loss_problems

    problems = fused_loss_problems(model.config)
    if model.post_process:
        problems += _output_layer_problems(model)
    if problems:
        raise ValueError(
            "--relaymoe-fused-loss cannot run this model:\n  - " + "\n  - ".join(problems)
        )
    if getattr(model.config, "cross_entropy_loss_fusion", False):
        _log_once(
            "ce-fusion",
            "--relaymoe-fused-loss replaces the loss that --cross-entropy-loss-fusion would "
            "fuse (the same cross-entropy): that flag has no effect on GPTModel's loss",
        )
    setattr(model, ATTR, functools.partial(fused_output_processor, chunk_tokens=chunk_tokens))
    chunk = "default" if chunk_tokens is None else f"{chunk_tokens} tokens"
    _log_once(
        "active",
        f"output layer + loss: relaymoe.linear_cross_entropy (--relaymoe-fused-loss, chunk "
        f"{chunk}); Megatron's own path for logits and inference",
    )
