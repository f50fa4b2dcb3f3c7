"""The checks of ``linear_cross_entropy``'s arguments, and the validated setup of one call.

Every refusal is a ``ValueError`` naming the value, the limit and the fix; ``check_labels`` is
the label range check of a call without tensor parallelism (one host sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.lossmodel import default_chunk_tokens


@dataclass(frozen=True)
class LossSetup:
    """What one call needs besides its tensors (validated)."""

    vocab_local: int
    vocab_start: int
    world: int
    group: object  # the process group when world > 1, else None
    chunk: int
    ignore_index: int
    smoothing: float  # Megatron's rescaled smoothing ``a * Vl / (Vl - 1)``, 0 without
    smoothing_arg: float  # the caller's ``a``
    impl: str  # "torch" | "triton"
    work: torch.dtype  # statistics dtype: fp32, or fp64 for fp64 inputs


def make_setup(hidden, weight, labels, group, chunk_tokens, ignore_index, smoothing, impl,
               wgrad="kept"):  # fmt: skip
    """The validated setup of one call; ``wgrad``: where its weight gradient goes
    (``lossmodel.WGRAD_MODES``), which with the impl decides the default chunk."""
    name = "linear_cross_entropy"
    if not isinstance(hidden, Tensor) or hidden.dim() != 2:
        raise ValueError(f"{name}: hidden_TH must be a 2-D (T, H) tensor, got {_desc(hidden)}")
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"{name}: weight_VH must be a 2-D (Vl, H) tensor, got {_desc(weight)}")
    tokens, hid = hidden.shape
    vocab_local = weight.shape[0]
    if weight.shape[1] != hid:
        raise ValueError(
            f"{name}: weight_VH has H={weight.shape[1]} columns but hidden_TH has H={hid}; "
            "pass the output layer's (Vl, H) weight (not its transpose)"
        )
    if vocab_local < 1:
        raise ValueError(f"{name}: weight_VH has {vocab_local} rows; each rank needs >= 1")
    if hidden.dtype not in FLOATS or hidden.dtype != weight.dtype:
        raise ValueError(
            f"{name}: hidden_TH ({hidden.dtype}) and weight_VH ({weight.dtype}) must share one "
            "float dtype of float16, bfloat16, float32, float64; cast one of them"
        )
    if not isinstance(labels, Tensor) or labels.shape != (tokens,):
        raise ValueError(
            f"{name}: labels_T must have shape ({tokens},) to match hidden_TH, got "
            f"{_desc(labels)}; flatten (S, B) labels the way hidden was flattened"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"{name}: labels_T must be an integer tensor, got {labels.dtype}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(
            f"{name}: hidden_TH ({hidden.device}), weight_VH ({weight.device}) and labels_T "
            f"({labels.device}) must be on one device"
        )
    resolved = resolve_impl(impl, hidden.device)
    if chunk_tokens is None:
        chunk = default_chunk_tokens(tokens, vocab_local, wgrad=wgrad, impl=resolved,
                                     act_bytes=hidden.element_size())  # fmt: skip
    elif isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(
            f"{name}: chunk_tokens={chunk_tokens!r} must be a positive int (or None for "
            "lossmodel.default_chunk_tokens)"
        )
    else:
        chunk = min(chunk_tokens, max(tokens, 1))
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(
            f"{name}: ignore_index={ignore_index!r} must be an int (the label of tokens to skip)"
        )
    if not _INT64_MIN <= ignore_index <= _INT64_MAX:
        raise ValueError(
            f"{name}: ignore_index={ignore_index} is outside the int64 range "
            f"[{_INT64_MIN}, {_INT64_MAX}] of the labels (widened to int64); use a label no "
            "token has inside it (Megatron's -100, or any negative int64)"
        )
    if isinstance(smoothing, bool) or not isinstance(smoothing, int | float):
        raise ValueError(f"{name}: label_smoothing={smoothing!r} must be a number in [0, 1)")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"{name}: label_smoothing={smoothing!r} must be in [0, 1); 0 disables it")
    if smoothing > 0 and vocab_local < 2:
        raise ValueError(
            f"{name}: label_smoothing={smoothing} needs Vl >= 2 vocabulary rows per rank "
            f"(Megatron divides by Vl - 1), got Vl={vocab_local}; use label_smoothing=0"
        )
    world, rank, pg = 1, 0, None
    if group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"{name}: tp_group was given but torch.distributed is not initialised; "
                "initialise it or pass tp_group=None"
            )
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if world > 1:
            pg = group
    return LossSetup(
        vocab_local=vocab_local,
        vocab_start=rank * vocab_local,
        world=world,
        group=pg,
        chunk=chunk,
        ignore_index=int(ignore_index),
        smoothing=float(smoothing) * vocab_local / (vocab_local - 1) if smoothing > 0 else 0.0,
        smoothing_arg=float(smoothing),
        impl=resolved,
        work=torch.float64 if hidden.dtype == torch.float64 else torch.float32,
    )


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # the labels' range (widened to int64)


def _desc(x) -> str:
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)} {x.dtype}"
    return f"{type(x).__name__}"


def resolve_impl(impl: str, device: torch.device) -> str:
    """The impl a call with ``impl`` runs on ``device``: ``"auto"`` is Triton on CUDA where it
    imports, else torch; ``"triton"`` where Triton cannot run raises ``ValueError``."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"linear_cross_entropy: impl={impl!r}; use 'auto', 'torch' or 'triton'")
    from relaymoe.kernels import interpret_mode, triton_available

    if impl == "torch":
        return impl
    usable = triton_available() and (device.type == "cuda" or interpret_mode())
    if impl == "triton" and not usable:
        raise ValueError(
            f"linear_cross_entropy: impl='triton' needs Triton and a CUDA device (or "
            f"TRITON_INTERPRET=1 on CPU); the inputs are on {device}; use impl='torch'"
        )
    if impl == "triton":
        return impl
    return "triton" if usable and device.type == "cuda" else "torch"


def wgrad_mode(weight_grad_into, expected_grad) -> str:
    """Where a call's weight gradient goes (``lossmodel.WGRAD_MODES``), from its arguments."""
    if weight_grad_into is None:
        return "kept"
    return "recompute" if expected_grad is None else "accumulate"


def check_labels(labels: Tensor, setup: LossSetup) -> None:
    vocab = setup.vocab_local * setup.world
    bad = ((labels < 0) | (labels >= vocab)) & (labels != setup.ignore_index)
    if bad.any():  # host sync
        first = labels[bad][0].item()
        raise ValueError(
            f"linear_cross_entropy: label {first} is outside [0, {vocab}) (V = Vl "
            f"{setup.vocab_local} x TP {setup.world}) and is not ignore_index="
            f"{setup.ignore_index}; fix the labels or mark those tokens with ignore_index"
        )


def check_accumulate_args(acc, expected, hidden: Tensor, weight: Tensor):
    """The accumulate mode's arguments (``weight_grad_into``, ``expected_grad``), checked:
    ``(acc, expected)`` with a Python number as a float."""
    name = "linear_cross_entropy"
    if acc is None:
        if expected is not None:
            raise ValueError(
                f"{name}: expected_grad={_desc(expected)} was given without weight_grad_into; "
                "the expectation is that of the weight gradient added into an accumulator: pass "
                "weight_grad_into=the (Vl, H) accumulator, or drop expected_grad"
            )
        return None, None
    if not isinstance(acc, Tensor) or tuple(acc.shape) != tuple(weight.shape):
        raise ValueError(
            f"{name}: weight_grad_into must be a tensor of the weight's shape "
            f"{tuple(weight.shape)}, got {_desc(acc)}; pass the weight's gradient accumulator "
            "(Megatron: weight.main_grad)"
        )
    if acc.dtype not in (torch.float32, weight.dtype) or acc.device != weight.device:
        raise ValueError(
            f"{name}: weight_grad_into is {acc.dtype} on {acc.device}; it must be float32 or "
            f"the weight's dtype ({weight.dtype}), on the weight's device ({weight.device})"
        )
    if acc.requires_grad or not acc.is_contiguous():
        raise ValueError(
            f"{name}: weight_grad_into must be a contiguous buffer outside autograd (requires_grad "
            f"{acc.requires_grad}, strides {acc.stride()}); pass a plain contiguous gradient "
            "buffer, such as Megatron's main_grad"
        )
    if acc.data_ptr() == weight.data_ptr() and acc.numel():
        raise ValueError(f"{name}: weight_grad_into is the weight itself; pass its gradient buffer")
    return acc, _check_expected(expected, hidden)


def _check_expected(expected, hidden: Tensor):
    name = "linear_cross_entropy"
    if expected is None:
        return None
    if isinstance(expected, Tensor):
        if expected.numel() != 1 or expected.dim() != 0 or not expected.is_floating_point():
            raise ValueError(
                f"{name}: expected_grad must be a Python float or a 0-dim floating tensor, got "
                f"{_desc(expected)}"
            )
        if expected.device != hidden.device:
            raise ValueError(
                f"{name}: expected_grad is on {expected.device}, hidden_TH on {hidden.device}: "
                "keep the expectation on the activations' device (no host sync to read it)"
            )
        return expected
    if isinstance(expected, bool) or not isinstance(expected, int | float):
        raise ValueError(
            f"{name}: expected_grad={expected!r} must be a Python float or a 0-dim tensor"
        )
    if not math.isfinite(expected) or expected == 0:
        raise ValueError(
            f"{name}: expected_grad={expected!r} must be finite and non-zero (the gradient the "
            "loss will send to every counted token); pass None when it is not known"
        )
    return float(expected)
