"""``--relaymoe-fused-loss``: GPTModel's output layer + cross-entropy without the logits.

With the flag, a ``GPTModel`` built after ``register()`` computes its language-model loss
through ``relaymoe.linear_cross_entropy`` whenever it is given labels outside inference: no
``(tokens, V/TP)`` logits tensor exists. Labels ``None`` (logits wanted), inference, a caller's
own ``output_processor`` and gathered logits at TP > 1 take Megatron's path untouched.

It plugs into Megatron's own hook: ``GPTModel._postprocess`` calls an ``output_processor``
after the MTP block with the final hidden states, the output layer and the tied output weight;
the patch (``relaymoe/megatron/patches.py``) passes the model's ``FusedOutputProcessor`` there.

``output_layer_loss`` reproduces ``ColumnParallelLinear`` + ``compute_language_model_loss``:

* the weight is the output layer's, or with tied embeddings the embedding's (Megatron hands it
  over as ``output_weight``), so its gradient reaches the embedding as in Megatron;
* the input mapping is the layer's: with sequence parallelism the hidden states are gathered
  over TP and their gradient reduce-scattered back; at TP > 1 without it, the gradient is
  all-reduced (each rank's vocabulary shard contributes a part of it);
* with ``gradient_accumulation_fusion`` the weight gradient is added to ``weight.main_grad``
  and the parameter marked ``grad_added_to_main_grad`` with the dummy gradient Megatron's linear
  returns; without it the gradient is a plain ``.grad`` for Megatron's DDP to pick up. An fp32
  ``main_grad`` (bf16 training), with fusion or under Megatron's DDP (whose hook adds ``.grad``
  into ``main_grad``: the same end), takes the loss's accumulate mode: the loss adds into it
  directly (no fp32 ``(V/TP, H)`` buffer of its own), during the forward with the upstream
  gradient guessed from the previous micro-batch's (``GradGuess``; the backward corrects it
  exactly where the guess was wrong), and the mark and dummy reach the weight only after the
  loss's whole backward (``_MainGradMark``). With tied embeddings the embedding's own gradient
  still arrives through ``.grad`` beside the zeroed dummy (Megatron sets ``zero_out_wgrad``
  there) and DDP adds it to ``main_grad`` as before;
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
import weakref

import torch

from relaymoe.megatron.main_grad import add_to_main_grad, handed_back

logger = logging.getLogger("relaymoe.megatron")

__all__ = ["IGNORE_INDEX", "FusedOutputProcessor", "GradGuess", "install", "output_layer_loss"]

IGNORE_INDEX = -100
ATTR = "_relaymoe_fused_loss"  # on a GPTModel: its output processor, set by install()
GUARD = "__relaymoe_settled_guard__"  # on a wrapped finalize_model_grads_func: its processor


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
    what Megatron's linear returns under ``gradient_accumulation_fusion`` (the loss's default
    mode: a ``main_grad`` that is not fp32, or Megatron-FSDP's)."""

    @staticmethod
    def forward(ctx, weight_VH):
        ctx.weight = weight_VH  # the parameter itself: main_grad and the marks live on it
        return weight_VH.view_as(weight_VH)

    @staticmethod
    def backward(ctx, grad_VH):
        add_to_main_grad(ctx.weight, grad_VH)
        return handed_back([ctx.weight])[0]


class _MainGradMark(torch.autograd.Function):
    """Identity on the hidden states that ties the weight to them in the graph: the loss adds
    the weight's gradient into ``main_grad`` itself (its accumulate mode) and returns none, and
    this node, upstream of the loss, runs its backward after the loss's whole backward: only
    then does the weight receive the dummy and the mark Megatron's DDP hook reads (its bucket
    may start reducing ``main_grad`` from that hook)."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH):
        ctx.weight = weight_VH
        return hidden_TH.view_as(hidden_TH)

    @staticmethod
    def backward(ctx, grad_TH):
        return grad_TH, handed_back([ctx.weight])[0]


class GradGuess:
    """The upstream gradient the next micro-batch's loss will send each counted token, guessed
    from the last one observed (device scalars: no host sync), for the fused loss's speculative
    weight gradient. Megatron's schedule divides a micro-batch's summed loss by its counted
    tokens ``n`` unless ``config.calculate_per_token_loss`` (then by the total at the end): the
    guess is the last ``g`` (exact while ``n`` does not change), rescaled by ``n_last / n``
    when it does, so a new token count costs nothing; a change of loss scale, of micro-batch
    count, or a weighted loss mask costs the backward's correction, never the gradient's
    exactness. One per output processor (one model), never global."""

    def __init__(self):
        # the last observation's g and its counted tokens n, 0-dim, updated in place (a CUDA
        # graph that captured the update keeps updating the tensors the next forward reads)
        self.g = None
        self.n = None

    def expected(self, counted_n, per_token_loss: bool):
        """This micro-batch's guess (None before any observation): the last ``g`` itself when
        the loss is per token or the count is unchanged (exact: the same value Megatron's
        schedule computes again), else ``g * n_last / n``."""
        if self.g is None:
            return None
        if per_token_loss:
            return self.g
        n = counted_n.clamp_min(1)
        return torch.where(n == self.n, self.g, self.g * self.n / n)

    def observe(self, valid_T, counted_n, per_token_loss: bool):
        """A hook for the loss tensor: records the gradient one counted token receives."""

        def hook(g_T):
            g = g_T.reshape(-1)[valid_T.to(torch.int8).argmax()].float()
            n = counted_n.clamp_min(1).float()
            ok = valid_T.any() & torch.isfinite(g) & (g != 0)
            if self.g is None:
                self.g = g.new_full((), float("nan"))
                self.n = n.new_ones(())
            self.g.copy_(torch.where(ok, g, self.g))
            self.n.copy_(torch.where(ok, n, self.n))

        return hook


def output_layer_loss(
    output_layer,
    hidden_SBH: torch.Tensor,
    labels_BS: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    loss_mask_BS: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    label_smoothing: float = 0.0,
    guess: GradGuess | None = None,
) -> torch.Tensor:
    """Megatron's ``output_layer`` (a ``ColumnParallelLinear``) followed by its vocab-parallel
    cross-entropy, fused. Returns ``loss_BS`` float32.

    ``hidden_SBH``: the final hidden states ``(S/TP if sequence parallel else S, B, H)``;
    ``labels_BS`` and ``loss_mask_BS``: ``(B, S)``; ``weight``: ``(V/TP, H)``, the layer's own
    when ``None``; ``guess``: the processor's upstream-gradient guess (the speculative weight
    gradient; without one the accumulate mode computes it in the backward). Suffixes: S
    sequence, B micro-batch, H hidden, V vocabulary, T = S*B tokens.
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
    hidden_TH, labels_T = hidden_SBH.reshape(s * b, h), labels_SB.reshape(s * b)
    accumulate = {}
    if weight.requires_grad and _accumulates_into_main_grad(weight, output_layer):
        hidden_TH = _MainGradMark.apply(hidden_TH, weight)
        accumulate = _speculation(output_layer, weight, labels_T, guess)
        weight = weight.detach()  # its gradient goes to main_grad, the mark to autograd
    elif weight.requires_grad and output_layer.gradient_accumulation_fusion:
        weight = _IntoMainGrad.apply(weight)
    observe = accumulate.pop("observe", None)
    loss_T = _linear_cross_entropy()(
        hidden_TH,
        weight,
        labels_T,
        tp_group=group if tp > 1 else None,
        chunk_tokens=chunk_tokens,
        ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing,
        # Megatron's data pipeline made these labels (as its router made the ring's ids): no
        # host sync to check their range; an out-of-range label gets Megatron's own behaviour
        # (no target logit on any shard)
        validate=False,
        **accumulate,
    )
    if observe is not None and loss_T.requires_grad:
        loss_T.register_hook(observe)
    return loss_T.view(s, b).t().contiguous()


def _accumulates_into_main_grad(weight, output_layer) -> bool:
    """Whether the loss adds the weight gradient into ``main_grad`` itself (its accumulate mode,
    no fp32 ``(V/TP, H)`` buffer of its own): grad mode on, an fp32 ``main_grad`` (Megatron's for
    bf16 training), not Megatron-FSDP's (copied into, not added to), and either
    ``gradient_accumulation_fusion`` or Megatron's DDP marking the parameter
    (``grad_added_to_main_grad``): its backward hook adds ``.grad`` into ``main_grad`` anyway,
    so adding there directly, with the mark and the dummy that fusion hands it, ends the same
    with ``--no-gradient-accumulation-fusion`` too."""
    grad = getattr(weight, "main_grad", None)
    return (
        torch.is_grad_enabled()
        and (
            output_layer.gradient_accumulation_fusion or hasattr(weight, "grad_added_to_main_grad")
        )
        and not hasattr(weight, "__fsdp_param__")
        and isinstance(grad, torch.Tensor)
        and grad.dtype == torch.float32
        and tuple(grad.shape) == tuple(weight.shape)
        and grad.is_contiguous()
    )


def _speculation(output_layer, weight, labels_T, guess: GradGuess | None) -> dict:
    """The accumulate mode's keyword arguments, and the hook that feeds ``guess`` (``observe``)."""
    args = {"weight_grad_into": weight.main_grad}
    if guess is None or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        # without a guess the backward computes the weight gradient itself (one GEMM more).
        # A captured backward could not branch on a guess that missed (the op would stop the
        # device instead); its arithmetic equals the eager forward's whenever the eager guess
        # was exact, so a graphed step stays bitwise equal to the eager one (GradGuess)
        return args
    per_token = bool(getattr(output_layer.config, "calculate_per_token_loss", False))
    valid = labels_T != IGNORE_INDEX
    counted = valid.sum()
    args["expected_grad"] = guess.expected(counted, per_token)
    args["observe"] = guess.observe(valid, counted, per_token)
    return args


class FusedOutputProcessor:
    """An ``output_processor`` for ``GPTModel._postprocess`` (called with the keyword arguments
    it passes): the loss ``(B, S)`` fp32 from the final hidden states and the labels. It keeps
    what one model's loss carries from micro-batch to micro-batch: the upstream-gradient guess,
    and the accumulators its speculative forwards added into, which Megatron's finalize point
    (``config.finalize_model_grads_func``, wrapped at the first such forward) checks settled
    before the gradients are reduced (``relaymoe.loss.check_settled``)."""

    def __init__(self, chunk_tokens: int | None = None):
        self.chunk_tokens = chunk_tokens
        self.guess = GradGuess()
        self.accumulators: dict[int, weakref.ref] = {}

    def __call__(self, *, hidden_states, output_layer, output_weight, labels, loss_mask, **_):
        weight = output_layer.weight if output_weight is None else output_weight
        loss = output_layer_loss(
            output_layer,
            hidden_states,
            labels,
            weight=output_weight,
            loss_mask_BS=loss_mask,
            chunk_tokens=self.chunk_tokens,
            guess=self.guess,
        )
        grad = getattr(weight, "main_grad", None)
        if loss.requires_grad and isinstance(grad, torch.Tensor):
            known = self.accumulators.get(id(grad))
            if known is None or known() is not grad:
                self.accumulators[id(grad)] = weakref.ref(grad)
            self._guard_finalize(output_layer.config)
        return loss

    def check_settled(self) -> None:
        """Raise when a speculative forward's contribution in an accumulator is unsettled."""
        from relaymoe.loss import check_settled

        for ref in list(self.accumulators.values()):
            acc = ref()
            if acc is not None:
                check_settled(acc)

    def _guard_finalize(self, config) -> None:
        finalize = getattr(config, "finalize_model_grads_func", None)
        if finalize is None or getattr(finalize, GUARD, None) is self:
            return

        @functools.wraps(finalize)
        def guarded(*args, **kwargs):
            self.check_settled()
            return finalize(*args, **kwargs)

        setattr(guarded, GUARD, self)
        config.finalize_model_grads_func = guarded


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
    setattr(model, ATTR, FusedOutputProcessor(chunk_tokens))
    chunk = "default" if chunk_tokens is None else f"{chunk_tokens} tokens"
    _log_once(
        "active",
        f"output layer + loss: relaymoe.linear_cross_entropy (--relaymoe-fused-loss, chunk "
        f"{chunk}); Megatron's own path for logits and inference",
    )
