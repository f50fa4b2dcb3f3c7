"""Each rank's own checks of its ``ring_moe`` inputs: an error code and message, never a raise.

The agreement (``agree.py``) writes the code into this rank's row, so that every rank raises the
same ``ValueError`` for the first rank whose inputs fail.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaymoe.experts import resolve_backend
from relaymoe.options import GRAD_ACCUM_CHOICES, MODE_CHOICES, SCHEDULE_CHOICES, TRANSPORT_CHOICES
from relaymoe.ring.problem import RingRequest
from relaymoe.routing import validate_topk_idx

MODES = MODE_CHOICES  # the names live in relaymoe.options
TRANSPORTS = TRANSPORT_CHOICES
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICE_TYPES = ("cpu", "cuda")


class _Meta:
    """Shape/dtype/device of an expert-weight input in either form (tensor, or a list of
    per-expert tensors read as ``(len, *element_shape)``)."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def dim(self) -> int:
        return len(self.shape)


def _weight_meta(name: str, w, want: str) -> tuple[_Meta | None, str]:
    """(meta, "") of a weight input, or (None, error message)."""
    if isinstance(w, Tensor):
        return _Meta(w.shape, w.dtype, w.device), ""
    if not isinstance(w, (list, tuple)):
        return None, (
            f"{name} must be a torch.Tensor {want.replace('El', 'E_local')} or a list of E_local "
            f"per-expert tensors, got {type(w).__name__}"
        )
    if len(w) == 0:
        return None, f"{name} is an empty list; pass E_local >= 1 per-expert tensors"
    for j, t in enumerate(w):
        if not isinstance(t, Tensor):
            return None, f"{name}[{j}] must be a torch.Tensor, got {type(t).__name__}"
    w0 = w[0]
    for j, t in enumerate(w):
        if t.dim() != 2 or t.shape != w0.shape or t.dtype != w0.dtype or t.device != w0.device:
            return None, (
                f"{name} list elements must all be 2-D with one shape, dtype and device; element "
                f"0 is {tuple(w0.shape)} {w0.dtype} {w0.device}, element {j} is "
                f"{tuple(t.shape)} {t.dtype} {t.device}"
            )
    return _Meta((len(w), *w0.shape), w0.dtype, w0.device), ""


def _local_check(
    x,
    w13,
    w2,
    topk_idx,
    topk_probs,
    req: RingRequest,
    world: int,
    validate_ids: bool = True,
) -> tuple[int, str]:
    """(error code, message) of this rank's inputs; (0, "") when they are fine."""
    tensors = dict(x=x, topk_idx=topk_idx, topk_probs=topk_probs)
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            return 1, f"{name} must be a torch.Tensor, got {type(t).__name__}"
    m13, msg = _weight_meta("w13", w13, "(El, 2I, H)")
    if m13 is None:
        return 1, msg
    m2, msg = _weight_meta("w2", w2, "(El, H, I)")
    if m2 is None:
        return 1, msg
    if isinstance(w13, Tensor) != isinstance(w2, Tensor):
        return 1, "w13 and w2 must both be tensors or both be lists of per-expert tensors"
    mode, transport, schedule, gpus_per_node = (
        req.mode, req.transport, req.schedule, req.gpus_per_node
    )  # fmt: skip
    if mode not in MODES:
        return 2, f"mode must be one of {MODES}, got {mode!r}"
    if transport not in TRANSPORTS:
        return 2, f"transport must be one of {TRANSPORTS}, got {transport!r}"
    if schedule not in SCHEDULE_CHOICES:
        return 2, f"schedule must be one of {SCHEDULE_CHOICES}, got {schedule!r}"
    if req.grad_accum not in GRAD_ACCUM_CHOICES:
        return 2, f"grad_accum must be one of {GRAD_ACCUM_CHOICES}, got {req.grad_accum!r}"
    if gpus_per_node is not None and (
        isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1
    ):
        return 2, (
            f"gpus_per_node must be a positive int (the GPUs of one node in the EP group) or "
            f"None (from the ranks' hosts), got {gpus_per_node!r}"
        )
    if x.dim() != 2 or m13.dim() != 3 or m2.dim() != 3:
        return 3, (
            f"x must be (T, H), w13 (E_local, 2I, H), w2 (E_local, H, I); got x "
            f"{tuple(x.shape)}, w13 {m13.shape}, w2 {m2.shape}"
        )
    num_tokens, hidden = x.shape
    n_local, two_i, h13 = m13.shape
    if n_local < 1 or two_i % 2 or h13 != hidden or m2.shape != (n_local, hidden, two_i // 2):
        return 3, (
            f"shapes disagree: x {tuple(x.shape)}, w13 {m13.shape} (want (E_local >= 1, "
            f"2I, {hidden})), w2 {m2.shape} (want ({n_local}, {hidden}, {two_i // 2}))"
        )
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        return 3, f"topk_idx must be (T={num_tokens}, K), got {tuple(topk_idx.shape)}"
    if topk_probs.shape != topk_idx.shape:
        return 3, (
            f"topk_probs shape {tuple(topk_probs.shape)} must equal topk_idx's "
            f"{tuple(topk_idx.shape)}"
        )
    if x.dtype not in _FLOATS or not (x.dtype == m13.dtype == m2.dtype):
        return 4, (
            f"x, w13, w2 must share one float dtype of {_FLOATS}; got {x.dtype}, {m13.dtype}, "
            f"{m2.dtype}"
        )
    if topk_probs.dtype not in _FLOATS:
        return 4, f"topk_probs must be a float tensor, got {topk_probs.dtype}"
    devices = {t.device for t in tensors.values()} | {m13.device, m2.device}
    if len(devices) != 1:
        return 5, f"inputs are on different devices: {sorted(map(str, devices))}; move them to one"
    if x.device.type not in _DEVICE_TYPES:
        return 7, f"ring_moe runs on cpu or cuda tensors, got {x.device}"
    try:
        resolve_backend(req.backend, x.device, x.dtype)
    except ValueError as err:
        return 8, str(err)
    if not validate_ids:  # a trusted caller (a router): shapes only, no host sync
        if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
            return 4, f"topk_idx must hold integer expert ids, got dtype {topk_idx.dtype}"
        if not 1 <= topk_idx.shape[1] <= n_local * world:
            return 6, f"top-k K={topk_idx.shape[1]} must be in [1, E={n_local * world}]"
        return 0, ""
    try:
        validate_topk_idx(topk_idx, n_local * world)  # host sync
    except ValueError as err:
        return 6, f"{err} (E = E_local * world_size = {n_local} * {world})"
    return 0, ""
