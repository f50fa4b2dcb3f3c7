"""Each rank's own checks of its ``ring_moe`` inputs: an error code and message, never a raise.

Shape legend as in ``engine.py``; J the fc1 rows of one expert (``activation.fc1_rows(I)``: 2I
for a gated activation, I otherwise), checked against the request's activation.

The agreement (``agree.py``) writes the code into this rank's row, so that every rank raises the
same ``ValueError`` for the first rank whose inputs fail.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaymoe.experts import resolve_backend
from relaymoe.options import (
    GRAD_ACCUM_CHOICES,
    INT64_MAX,
    MODE_CHOICES,
    SCHEDULE_CHOICES,
    TRANSPORT_CHOICES,
)
from relaymoe.ring.plan import RingRequest
from relaymoe.routing import validate_topk_idx

MODES = MODE_CHOICES  # the names live in relaymoe.options
TRANSPORTS = TRANSPORT_CHOICES
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEVICE_TYPES = ("cpu", "cuda")


class _Meta:
    """Shape/dtype/device of an expert-weight input in either form (tensor, or a list of
    per-expert tensors read as ``(len, *element_shape)``)."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def dim(self) -> int:
        return len(self.shape)


def weight_meta(name: str, w, want: str, ndim: int = 2) -> tuple[_Meta | None, str]:
    """(meta, "") of a weight (``ndim=2`` per expert) or bias (``ndim=1``) input, or (None,
    error message)."""
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
        if t.dim() != ndim or t.shape != w0.shape or t.dtype != w0.dtype or t.device != w0.device:
            return None, (
                f"{name} list elements must all be {ndim}-D with one shape, dtype and device; "
                f"element 0 is {tuple(w0.shape)} {w0.dtype} {w0.device}, element {j} is "
                f"{tuple(t.shape)} {t.dtype} {t.device}"
            )
    return _Meta((len(w), *w0.shape), w0.dtype, w0.device), ""


def local_check(
    x,
    w13,
    w2,
    topk_idx,
    topk_probs,
    req: RingRequest,
    world: int,
    validate_ids: bool = True,
    b13=None,
    b2=None,
) -> tuple[int, str]:
    """(error code, message) of this rank's inputs; (0, "") when they are fine. ``b13``/``b2``:
    the optional expert biases, in the weights' form (tensors, or lists of per-expert 1-D
    tensors). The checks run in order, the first failure is the answer: the inputs' forms
    (code 1), the request's options (9, 10, 2), shapes (3), dtypes and devices (4, 5, 7), the
    hop backend (8), the expert ids (4, 6)."""
    m13, m2, biases, failed = _input_forms(x, w13, w2, topk_idx, topk_probs, b13, b2)
    if failed is not None:
        return failed
    return (
        _check_request(req)
        or _check_shapes(x, m13, m2, biases, topk_idx, topk_probs, req.activation)
        or _check_dtypes_devices(x, m13, m2, biases, topk_idx, topk_probs, req.backend)
        or _check_ids(topk_idx, m13.shape[0], world, validate_ids)
        or (0, "")
    )


def _input_forms(x, w13, w2, topk_idx, topk_probs, b13, b2):
    """``(m13, m2, biases, None)``: the weights' metas and the given biases' by name, or
    ``(None, None, None, (1, message))`` when an input is not in an accepted form."""
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_probs", topk_probs)):
        if not isinstance(t, Tensor):
            return None, None, None, (1, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    m13, msg = weight_meta("w13", w13, "(El, J, H)")
    if m13 is None:
        return None, None, None, (1, msg)
    m2, msg = weight_meta("w2", w2, "(El, H, I)")
    if m2 is None:
        return None, None, None, (1, msg)
    if isinstance(w13, Tensor) != isinstance(w2, Tensor):
        return None, None, None, (
            1, "w13 and w2 must both be tensors or both be lists of per-expert tensors"
        )  # fmt: skip
    biases = {}
    for name, b, want in (("b13", b13, "(El, J)"), ("b2", b2, "(El, H)")):
        if b is None:
            continue
        meta, msg = weight_meta(name, b, want, ndim=1)
        if meta is None:
            return None, None, None, (1, msg)
        if isinstance(b, Tensor) != isinstance(w13, Tensor):
            form, fix = ("tensors", f"a tensor {want}") if isinstance(w13, Tensor) else (
                "lists of per-expert tensors", "a list of E_local 1-D tensors")  # fmt: skip
            return None, None, None, (
                1, f"{name} must come in the weights' form: w13/w2 are {form}, pass {fix}"
            )  # fmt: skip
        biases[name] = meta
    return m13, m2, biases, None


def _check_request(req: RingRequest) -> tuple[int, str] | None:
    """The request's activation, kernels and ring options (None: fine)."""
    if isinstance(req.activation, str):  # request_activation's message of a bad activation
        return 9, req.activation
    if isinstance(req.kernels, str):  # request_kernels' message of a bad kernels=
        return 10, req.kernels
    mode, transport, schedule, gpus_per_node = (
        req.mode, req.transport, req.schedule, req.gpus_per_node
    )  # fmt: skip
    if mode not in MODES:
        return 2, f"mode must be one of {MODES}, got {mode!r}"
    if req.capturable and mode == "alltoall":
        return 2, (
            "mode='alltoall' sizes its messages on the host, which a captured CUDA graph cannot "
            "replay (capturable=True); use mode 'expert', 'token' or 'auto' (the ring modes)"
        )
    if transport not in TRANSPORTS:
        return 2, f"transport must be one of {TRANSPORTS}, got {transport!r}"
    if schedule not in SCHEDULE_CHOICES:
        return 2, f"schedule must be one of {SCHEDULE_CHOICES}, got {schedule!r}"
    if req.grad_accum not in GRAD_ACCUM_CHOICES:
        return 2, f"grad_accum must be one of {GRAD_ACCUM_CHOICES}, got {req.grad_accum!r}"
    if gpus_per_node is not None and (
        isinstance(gpus_per_node, bool)
        or not isinstance(gpus_per_node, int)
        or not 1 <= gpus_per_node <= INT64_MAX
    ):
        return 2, (
            f"gpus_per_node must be an int in [1, {INT64_MAX}] (the GPUs of one node in the EP "
            f"group) or None (from the ranks' hosts), got {gpus_per_node!r}"
        )
    return None


def _check_shapes(x, m13, m2, biases, topk_idx, topk_probs, act) -> tuple[int, str] | None:
    """x, the weights (w13's rows against the activation), the biases and the routing agree
    in shape (None: fine)."""
    if x.dim() != 2 or m13.dim() != 3 or m2.dim() != 3:
        return 3, (
            f"x must be (T, H), w13 (E_local, J, H), w2 (E_local, H, I); got x "
            f"{tuple(x.shape)}, w13 {m13.shape}, w2 {m2.shape}"
        )
    num_tokens, hidden = x.shape
    n_local, rows, h13 = m13.shape
    ffn = m2.shape[2]
    J = act.fc1_rows(ffn)
    if n_local < 1 or m2.shape[:2] != (n_local, hidden) or (rows, h13) != (J, hidden):
        how = "2I: gated" if act.gated else "I: not gated"
        return 3, (
            f"shapes disagree: x {tuple(x.shape)}, w2 {m2.shape} (want (E_local >= 1, "
            f"{hidden}, I)), w13 {m13.shape} (want ({n_local}, J={J}, {hidden}): J is "
            f"{how}, activation {act})"
        )
    for name, want in (("b13", (n_local, J)), ("b2", (n_local, hidden))):
        if name in biases and biases[name].shape != want:
            return 3, (
                f"{name} has shape {biases[name].shape}, want {want} (E_local, "
                f"{'J' if name == 'b13' else 'H'}) for w13 {m13.shape} and w2 {m2.shape}"
            )
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        return 3, f"topk_idx must be (T={num_tokens}, K), got {tuple(topk_idx.shape)}"
    if topk_probs.shape != topk_idx.shape:
        return 3, (
            f"topk_probs shape {tuple(topk_probs.shape)} must equal topk_idx's "
            f"{tuple(topk_idx.shape)}"
        )
    return None


def _check_dtypes_devices(x, m13, m2, biases, topk_idx, topk_probs,
                          backend) -> tuple[int, str] | None:  # fmt: skip
    """One float dtype for x, the weights and biases, one device, and a hop backend that runs
    them (None: fine)."""
    if x.dtype not in FLOATS or not (x.dtype == m13.dtype == m2.dtype):
        return 4, (
            f"x, w13, w2 must share one float dtype of {FLOATS}; got {x.dtype}, {m13.dtype}, "
            f"{m2.dtype}"
        )
    for name, meta in biases.items():
        if meta.dtype != x.dtype:
            return 4, f"{name} must have the weights' dtype {x.dtype}, got {meta.dtype}"
    if topk_probs.dtype not in FLOATS:
        return 4, f"topk_probs must be a float tensor, got {topk_probs.dtype}"
    devices = {t.device for t in (x, topk_idx, topk_probs)} | {m13.device, m2.device}
    devices |= {meta.device for meta in biases.values()}
    if len(devices) != 1:
        return 5, f"inputs are on different devices: {sorted(map(str, devices))}; move them to one"
    if x.device.type not in DEVICE_TYPES:
        return 7, f"ring_moe runs on cpu or cuda tensors, got {x.device}"
    try:
        resolve_backend(backend, x.device, x.dtype)
    except ValueError as err:
        return 8, str(err)
    return None


def _check_ids(topk_idx, n_local: int, world: int, validate_ids: bool) -> tuple[int, str] | None:
    """The expert ids: integer, K in [1, E]; validated in full (a host sync) unless trusted."""
    if not validate_ids:  # a trusted caller (a router): shapes only, no host sync
        if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
            return 4, f"topk_idx must hold integer expert ids, got dtype {topk_idx.dtype}"
        if not 1 <= topk_idx.shape[1] <= n_local * world:
            return 6, f"top-k K={topk_idx.shape[1]} must be in [1, E={n_local * world}]"
        return None
    try:
        validate_topk_idx(topk_idx, n_local * world)  # host sync
    except ValueError as err:
        return 6, f"{err} (E = E_local * world_size = {n_local} * {world})"
    return None
