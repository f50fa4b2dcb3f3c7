"""Chunked linear + cross-entropy: the language-model loss without a ``(T, V)`` logits tensor.

Shape legend: T tokens, H hidden, Vl vocabulary rows on this rank (``V / TP``), V the whole
vocabulary, C tokens of one chunk.

``linear_cross_entropy(hidden_TH, weight_VH, labels_T)`` returns the per-token loss of
``softmax(hidden @ weight_full.T)``, the value Megatron's output layer followed by
``tensor_parallel.vocab_parallel_cross_entropy`` returns: the logits are rounded to the
activations' dtype (the output layer's GEMM output), the statistics are taken in fp32, and the
vocabulary is split over ``tp_group`` as Megatron splits it (rank ``r`` holds global rows
``[r*Vl, (r+1)*Vl)``).

How (per chunk of ``C`` tokens, ``C`` from ``relaymoe.lossmodel.default_chunk_tokens``):
1. ``logits_CV = h_C @ W.T`` into one reused ``(C, Vl)`` buffer (activations' dtype).
2. Per-row max, sum-exp, target logit (and the row sum for label smoothing); across ``tp_group``
   an all-reduce MAX of the max, then one all-reduce SUM of the rescaled sum-exp and the target
   logit together.
3. When a gradient is wanted, the chunk's logits gradient ``softmax - onehot`` (label smoothing
   included, ignored tokens zero) overwrites the logits buffer, and is applied at once:
   ``dh_unit[C] = dlogits @ W`` and ``dW_unit += dlogits.T @ h_C`` (fp32 accumulation).
So the forward does the three GEMMs of the layer and the backward none: ``dh = g * dh_unit``
holds for any upstream gradient ``g``, and ``dW = c * dW_unit`` when ``g == c`` on every
non-ignored token (the loss-mask-times-constant form of a training loss once masked tokens carry
``ignore_index``). Backward checks that condition with one host sync; when it does not hold it
recomputes each chunk's logits and weight gradient weighted by ``g`` (exact, one GEMM pair more
per chunk).

Peak extra memory: one chunk's working set plus ``dh_unit`` (T, H, activations' dtype) and
``dW_unit`` (Vl, H, fp32), see ``relaymoe.lossmodel``. Deterministic: fixed chunk order, no
atomics.

Tensor parallelism. Every rank of ``tp_group`` passes the same ``hidden`` and ``labels`` (same
T) and its own shard of the weight. The hidden gradient returned is this rank's part
``dlogits_local @ W_local``; the caller sums it over the group, as Megatron's column-parallel
output layer does (``copy_to_tensor_model_parallel_region``, or the sequence-parallel gather,
whose backward all-reduces / reduce-scatters). The weight gradient is this rank's shard's, whole.

Label smoothing follows Megatron's formula (``smoothing = a * Vl / (Vl - 1)``, loss
``(1 - smoothing) * nll - smoothing * mean(log p)``) including its tensor-parallel behaviour:
``Vl`` and the mean are those of this rank's shard, so at TP > 1 with smoothing the ranks return
different losses, exactly as Megatron's do. At TP = 1 it equals ``torch.nn.functional
.cross_entropy(label_smoothing=a * V / (V - 1))``.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.lossmodel import default_chunk_tokens

__all__ = ["linear_cross_entropy"]

Impl = Literal["auto", "torch", "triton"]


@dataclass(frozen=True)
class _Setup:
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


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def linear_cross_entropy(
    hidden_TH: Tensor,
    weight_VH: Tensor,
    labels_T: Tensor,
    *,
    tp_group=None,
    chunk_tokens: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    impl: Impl = "auto",
    validate: bool = True,
) -> Tensor:
    """Per-token cross-entropy of ``hidden_TH @ weight_full.T`` without materialising the logits.

    Args:
        hidden_TH: (T, H) activations: float16, bfloat16, float32 or float64 (the weight's).
        weight_VH: (Vl, H) this rank's vocabulary shard, global rows ``[r*Vl, (r+1)*Vl)``.
        labels_T: (T,) integer global token ids in ``[0, Vl * TP)``, or ``ignore_index``.
        tp_group: the tensor-parallel process group over which the vocabulary is split;
            ``None`` is a group of one (the whole vocabulary is ``weight_VH``).
        chunk_tokens: tokens per chunk (default ``lossmodel.default_chunk_tokens(T, Vl)``).
        ignore_index: label (an int) whose tokens get loss 0 and zero gradients.
        label_smoothing: Megatron's label smoothing ``a`` in ``[0, 1)`` (see the module doc).
        impl: ``"triton"`` (row kernels, CUDA or ``TRITON_INTERPRET=1``), ``"torch"``, or
            ``"auto"`` (Triton on CUDA when it imports).
        validate: check the labels and, at TP > 1, the tensor-parallel contract (below).

    Returns:
        loss_T: (T,) float32 (float64 for float64 inputs). Differentiable into ``hidden_TH``
        (this rank's part, see the module doc) and ``weight_VH``.

    Layouts: any strides for ``hidden_TH``, ``weight_VH``, ``labels_T`` and the upstream
    gradient (transposed, sliced, expanded); the GEMMs read them in place and the row kernels
    see only the loss's own contiguous chunk buffer, so nothing is copied. Labels of any integer
    dtype are widened to int64 (T elements).

    Validated at call time, always (``ValueError`` naming the value, the limit and the fix):
    types, shapes, dtypes and devices, ``chunk_tokens``, ``label_smoothing``, ``ignore_index``,
    ``impl``. With ``validate=True`` (the default) also, with one host sync: every label is in
    ``[0, V)`` or ``ignore_index``; and at TP > 1 the contract the chunks' collectives rely on,
    on every rank at once in one small all-reduce read by that same host sync: the same T, H,
    Vl, chunk size, dtype, ignore_index, label_smoothing and labels on every rank of
    ``tp_group`` (every rank raises the same ``ValueError`` otherwise, instead of a hang or a
    wrong loss). ``validate=False`` (Megatron's output processor, whose ranks hold the same
    batch by construction) skips both, with no host sync and no extra collective: labels out of
    range then count as a target on no rank, and ranks that break the contract hang or fail in
    the first chunk's all-reduce. ``validate`` itself must be the same on every rank.
    Trusted always: that every rank passes the same ``hidden_TH`` values.
    """
    setup = _make_setup(
        hidden_TH, weight_VH, labels_T, tp_group, chunk_tokens, ignore_index, label_smoothing,
        impl,
    )  # fmt: skip
    labels_T = labels_T.long()
    if validate and setup.world > 1:
        _agree_tp(hidden_TH, labels_T, setup)
    elif validate:
        _check_labels(labels_T, setup)
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and hidden_TH.requires_grad
    need_dw = grad_on and weight_VH.requires_grad
    if not (need_dh or need_dw):  # eval: statistics only, no gradient pass, nothing kept
        with torch.no_grad():
            return _forward(hidden_TH, weight_VH, labels_T, setup, False, False)[0]
    return _LinearCrossEntropy.apply(hidden_TH, weight_VH, labels_T, setup, need_dh, need_dw)


# --------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------
def _make_setup(hidden, weight, labels, group, chunk_tokens, ignore_index, smoothing, impl):
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
    if hidden.dtype not in _FLOATS or hidden.dtype != weight.dtype:
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
    if chunk_tokens is None:
        chunk = default_chunk_tokens(tokens, vocab_local)
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
    return _Setup(
        vocab_local=vocab_local,
        vocab_start=rank * vocab_local,
        world=world,
        group=pg,
        chunk=chunk,
        ignore_index=int(ignore_index),
        smoothing=float(smoothing) * vocab_local / (vocab_local - 1) if smoothing > 0 else 0.0,
        smoothing_arg=float(smoothing),
        impl=_resolve_impl(impl, hidden.device),
        work=torch.float64 if hidden.dtype == torch.float64 else torch.float32,
    )


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _desc(x) -> str:
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)} {x.dtype}"
    return f"{type(x).__name__}"


def _resolve_impl(impl: str, device: torch.device) -> str:
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


def _check_labels(labels: Tensor, setup: _Setup) -> None:
    vocab = setup.vocab_local * setup.world
    bad = ((labels < 0) | (labels >= vocab)) & (labels != setup.ignore_index)
    if bad.any():  # host sync
        first = labels[bad][0].item()
        raise ValueError(
            f"linear_cross_entropy: label {first} is outside [0, {vocab}) (V = Vl "
            f"{setup.vocab_local} x TP {setup.world}) and is not ignore_index="
            f"{setup.ignore_index}; fix the labels or mark those tokens with ignore_index"
        )


# The tensor-parallel contract, one row per rank (see ``_agree_tp``)
_TP_FIELDS = ("T", "H", "Vl", "chunk", "dtype", "ignore_index", "smoothing", "labels", "bad",
              "first_bad", "live")  # fmt: skip
_TP_WHAT = {
    "T": ("the token count T (hidden_TH.shape[0])", "every rank passes the same hidden_TH and "
          "labels_T"),
    "H": ("the hidden size H", "every rank passes the same hidden_TH"),
    "Vl": ("the vocabulary shard size Vl (weight_VH.shape[0])", "the vocabulary is split "
           "evenly, rank r holding rows [r*Vl, (r+1)*Vl): pad it to a multiple of the TP size "
           "(Megatron's make_vocab_size_divisible_by)"),
    "chunk": ("the chunk size (chunk_tokens)", "pass the same chunk_tokens (or None) on every "
              "rank"),
    "dtype": ("the dtype (code 1 float16, 2 bfloat16, 3 float32, 4 float64)", "use one dtype "
              "on every rank"),
    "ignore_index": ("ignore_index", "pass the same ignore_index on every rank"),
    "smoothing": ("label_smoothing", "pass the same label_smoothing on every rank"),
    "labels": ("labels_T (a checksum of them)", "every rank passes the same labels_T"),
}  # fmt: skip


def _agree_tp(hidden: Tensor, labels: Tensor, setup: _Setup) -> None:
    """Check, on every rank of ``tp_group`` at once, the contract the chunk loop's collectives
    rely on: one T, H, Vl, chunk size, dtype, ignore_index, smoothing and labels on every rank,
    and every label in range. Each rank writes one row of integers (its own values, a checksum
    of its labels, its first bad label, a validity marker) into a (TP, F) matrix; one all-reduce
    (sum) of that fixed-size matrix gives every rank every row, and the one host read of it
    replaces the label check's host sync. So ranks that broke the contract (different T, shards
    of different sizes) all raise the same ``ValueError`` before any size-dependent collective,
    instead of a hang, a transport error or a wrong loss. A row whose marker is missing (a peer
    that failed the collective) is never read as data."""
    dev, world = hidden.device, setup.world
    rank = dist.get_rank(setup.group)
    tokens, hid = hidden.shape
    vocab = setup.vocab_local * world
    bad = ((labels < 0) | (labels >= vocab)) & (labels != setup.ignore_index)
    weights = torch.arange(1, tokens + 1, dtype=torch.int64, device=dev)
    host = [tokens, hid, setup.vocab_local, setup.chunk, _FLOATS.index(hidden.dtype) + 1,
            setup.ignore_index, _float_bits(setup.smoothing_arg), 0, 0, 0, 1]  # fmt: skip
    mat = torch.zeros(world, len(_TP_FIELDS), dtype=torch.int64, device=dev)
    mat[rank] = torch.tensor(host, dtype=torch.int64).to(dev, non_blocking=True)  # no sync
    if tokens:
        first = torch.argmax(bad.to(torch.int8))  # the first bad label's position (device)
        mat[rank, _TP_FIELDS.index("labels")] = (labels * weights).sum()
        mat[rank, _TP_FIELDS.index("bad")] = bad.any().to(torch.int64)
        mat[rank, _TP_FIELDS.index("first_bad")] = labels[first]
    dist.all_reduce(mat, op=dist.ReduceOp.SUM, group=setup.group)
    rows = mat.tolist()  # host sync (the one the label check made)
    live = [r[_TP_FIELDS.index("live")] for r in rows]
    if live != [1] * world:
        raise RuntimeError(
            f"linear_cross_entropy: the tensor-parallel check's all-reduce lacks the validity "
            f"marker of ranks {[r for r, v in enumerate(live) if v != 1]} (markers {live}); a "
            "peer failed, its result is not used"
        )
    for j, key in enumerate(_TP_FIELDS[:7]):  # the sizes and settings first
        _same_on_every_rank(key, [r[j] for r in rows])
    for r, row in enumerate(rows):
        if row[_TP_FIELDS.index("bad")]:
            raise ValueError(
                f"linear_cross_entropy: label {row[_TP_FIELDS.index('first_bad')]} (on rank {r} "
                f"of tp_group) is outside [0, {vocab}) (V = Vl {setup.vocab_local} x TP "
                f"{world}) and is not ignore_index={setup.ignore_index}; fix the labels or "
                "mark those tokens with ignore_index"
            )
    _same_on_every_rank("labels", [r[_TP_FIELDS.index("labels")] for r in rows])


def _same_on_every_rank(key: str, values: list[int]) -> None:
    if len(set(values)) != 1:
        what, fix = _TP_WHAT[key]
        shown = values if key not in ("smoothing", "labels") else _shown(key, values)
        raise ValueError(
            f"linear_cross_entropy: {what} differs across tp_group (by rank): {shown}; {fix}"
        )


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _shown(key: str, values: list[int]) -> list:
    if key == "smoothing":
        return [struct.unpack("<d", struct.pack("<q", v))[0] for v in values]
    return ["same" if v == values[0] else "different" for v in values]


# --------------------------------------------------------------------------------------------
# per-chunk pieces: statistics and gradient (torch and Triton), the TP combine, the wgrad GEMM
# --------------------------------------------------------------------------------------------
def _stats_torch(logits_CV: Tensor, tgt_C: Tensor, want_sum: bool, work: torch.dtype):
    z = logits_CV.to(work, copy=True)
    rowsum = z.sum(-1) if want_sum else None
    target = z.gather(1, tgt_C.clamp_min(0)[:, None]).squeeze(1).masked_fill_(tgt_C < 0, 0.0)
    rowmax = z.amax(-1)
    sumexp = z.sub_(rowmax[:, None]).exp_().sum(-1)
    return rowmax, sumexp, target, rowsum


def _grad_torch(logits_CV, tgt_C, lse_C, scale_C, smooth, target_weight, work):
    p = logits_CV.to(work, copy=True).sub_(lse_C[:, None]).exp_()
    if smooth:
        p.sub_(smooth)
    hit = (tgt_C >= 0).to(work).mul_(-target_weight)
    p.scatter_add_(1, tgt_C.clamp_min(0)[:, None], hit[:, None])
    p.mul_(scale_C[:, None])
    return logits_CV.copy_(p)


def _stats(logits_CV, tgt_C, setup: _Setup):
    want_sum = setup.smoothing > 0
    if setup.impl == "triton":
        from relaymoe.kernels.cross_entropy import row_stats

        return row_stats(logits_CV, tgt_C, want_sum=want_sum)
    return _stats_torch(logits_CV, tgt_C, want_sum, setup.work)


def _grad(logits_CV, tgt_C, lse_C, scale_C, setup: _Setup) -> Tensor:
    """The chunk's logits gradient, written over ``logits_CV`` (returned)."""
    smooth = setup.smoothing / setup.vocab_local
    target_weight = 1.0 - setup.smoothing
    if setup.impl == "triton":
        from relaymoe.kernels.cross_entropy import row_grad

        return row_grad(logits_CV, tgt_C, lse_C, scale_C, smooth=smooth,
                        target_weight=target_weight)  # fmt: skip
    return _grad_torch(logits_CV, tgt_C, lse_C, scale_C, smooth, target_weight, setup.work)


def _combine(rowmax, sumexp, target, rowsum, has_target, setup: _Setup):
    """Global ``(loss_C, lse_C)`` from this rank's per-row statistics: the all-reduces Megatron
    makes (max; then sum-exp and target logit, here in one call)."""
    gmax = rowmax
    if setup.world > 1:
        gmax = rowmax.clone()
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=setup.group)
    packed = torch.stack(
        [sumexp * torch.exp(rowmax - gmax), torch.where(has_target, target - gmax, 0.0)]
    )
    if setup.world > 1:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=setup.group)
    log_sumexp = torch.log(packed[0])
    loss = log_sumexp - packed[1]
    if setup.smoothing > 0:
        # Megatron's mean(log softmax) over this rank's shard, in closed form (no log of 0)
        mean_log_p = rowsum / setup.vocab_local - gmax - log_sumexp
        loss = (1.0 - setup.smoothing) * loss - setup.smoothing * mean_log_p
    return loss, gmax + log_sumexp


@functools.cache
def _mixed_wgrad_mode(device: torch.device) -> str:
    """How this device accumulates ``acc_fp32 += a_half @ b_half``: ``"addmm"`` (one GEMM with
    an fp32 output and beta=1, ``torch.addmm(..., out_dtype=)``), ``"mm"`` (an fp32-output GEMM,
    then an add), else ``"upcast"`` (operands converted to fp32: exact, slower). Probed once."""
    if device.type != "cuda":
        return "upcast"  # the fp32-output GEMMs exist only for CUDA
    a = torch.arange(6, device=device, dtype=torch.bfloat16).reshape(3, 2)
    b = torch.ones(2, 4, device=device, dtype=torch.bfloat16)
    want = torch.full((3, 4), 1.0, device=device) + a.float() @ b.float()
    try:
        acc = torch.ones(3, 4, device=device)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        if torch.equal(acc, want):
            return "addmm"
    except (TypeError, RuntimeError, NotImplementedError):  # older torch: no out_dtype
        pass
    try:
        if torch.equal(1.0 + torch.mm(a, b, out_dtype=torch.float32), want):
            return "mm"
    except (TypeError, RuntimeError, NotImplementedError):
        pass
    return "upcast"


def _accumulate_wgrad(acc_VH: Tensor, dlogits_CV: Tensor, h_CH: Tensor) -> None:
    """``acc_VH += dlogits_CV.T @ h_CH`` with the product accumulated in ``acc_VH``'s dtype."""
    a = dlogits_CV.t()
    if dlogits_CV.dtype == acc_VH.dtype:
        acc_VH.addmm_(a, h_CH)
        return
    mode = _mixed_wgrad_mode(acc_VH.device)
    if mode == "addmm":
        torch.addmm(acc_VH, a, h_CH, out_dtype=acc_VH.dtype, out=acc_VH)
    elif mode == "mm":
        acc_VH.add_(torch.mm(a, h_CH, out_dtype=acc_VH.dtype))
    else:
        acc_VH.addmm_(a.to(acc_VH.dtype), h_CH.to(acc_VH.dtype))


# --------------------------------------------------------------------------------------------
# forward over chunks, and the backward's recompute
# --------------------------------------------------------------------------------------------
def _targets(labels_T: Tensor, setup: _Setup) -> tuple[Tensor, Tensor]:
    """``(tgt_T, valid_T)``: the label's local column (-1 when ignored or on another rank) and
    whether the token counts."""
    valid = labels_T != setup.ignore_index
    local = labels_T - setup.vocab_start
    here = valid & (local >= 0) & (local < setup.vocab_local)
    return torch.where(here, local, -1), valid


def _forward(hidden, weight, labels, setup: _Setup, need_dh: bool, need_dw: bool):
    tokens, hid = hidden.shape
    dev = hidden.device
    loss = torch.zeros(tokens, dtype=setup.work, device=dev)
    lse = torch.empty(tokens, dtype=setup.work, device=dev)
    tgt, valid = _targets(labels, setup)
    dh_unit = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_dh else None
    dw_unit = torch.zeros(setup.vocab_local, hid, dtype=setup.work, device=dev) if need_dw else None
    if tokens:
        buf = torch.empty(min(setup.chunk, tokens), setup.vocab_local, dtype=hidden.dtype,
                          device=dev)  # fmt: skip
        w_t = weight.t()
        for s in range(0, tokens, setup.chunk):
            e = min(s + setup.chunk, tokens)
            h = hidden[s:e]
            logits = torch.mm(h, w_t, out=buf[: e - s])
            stats = _stats(logits, tgt[s:e], setup)
            loss_c, lse[s:e] = _combine(*stats, tgt[s:e] >= 0, setup)
            loss[s:e] = torch.where(valid[s:e], loss_c, 0.0)
            if need_dh or need_dw:
                scale = valid[s:e].to(setup.work)
                dlogits = _grad(logits, tgt[s:e], lse[s:e], scale, setup)
                if need_dh:
                    torch.mm(dlogits, weight, out=dh_unit[s:e])
                if need_dw:
                    _accumulate_wgrad(dw_unit, dlogits, h)
        del buf
    return loss, lse, tgt, valid, dh_unit, dw_unit


def _recompute_wgrad(hidden, weight, tgt, lse, scale, setup: _Setup) -> Tensor:
    """``sum_t scale[t] * dlogits[t].T @ h[t]`` by chunks again (the backward's exact path)."""
    tokens, hid = hidden.shape
    acc = torch.zeros(setup.vocab_local, hid, dtype=setup.work, device=hidden.device)
    buf = torch.empty(min(setup.chunk, tokens), setup.vocab_local, dtype=hidden.dtype,
                      device=hidden.device)  # fmt: skip
    w_t = weight.t()
    for s in range(0, tokens, setup.chunk):
        e = min(s + setup.chunk, tokens)
        logits = torch.mm(hidden[s:e], w_t, out=buf[: e - s])
        dlogits = _grad(logits, tgt[s:e], lse[s:e], scale[s:e].contiguous(), setup)
        _accumulate_wgrad(acc, dlogits, hidden[s:e])
    return acc


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, setup, need_dh, need_dw):
        loss, lse, tgt, valid, dh_unit, dw_unit = _forward(
            hidden, weight, labels, setup, need_dh, need_dw
        )
        ctx.setup, ctx.need_dh, ctx.need_dw = setup, need_dh, need_dw
        keep = (hidden, weight) if need_dw else (None, None)  # inputs: the recompute's operands
        ctx.save_for_backward(*keep, lse, tgt, valid, dh_unit, dw_unit)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_T):
        hidden, weight, lse, tgt, valid, dh_unit, dw_unit = ctx.saved_tensors
        setup = ctx.setup
        g = torch.where(valid, g_T.to(setup.work), 0.0)  # ignored tokens: zero, even if g is NaN
        dh = dw = None
        if ctx.need_dh:
            dh = torch.mul(dh_unit, g[:, None], out=torch.empty_like(dh_unit))
        if ctx.need_dw:
            dw = torch.empty_like(weight)
            g_max = torch.where(valid, g, -torch.inf).amax() if g.numel() else g.new_zeros(())
            g_min = torch.where(valid, g, torch.inf).amin() if g.numel() else g.new_zeros(())
            any_valid = valid.any()
            # uniform over the counted tokens (or none counted): dW = c * dW_unit
            if bool((g_max == g_min) | ~any_valid):  # host sync
                c = torch.where(any_valid, g_max, 0.0)
                torch.mul(dw_unit, c, out=dw)
            else:
                dw.copy_(_recompute_wgrad(hidden, weight, tgt, lse, g, setup))
        return dh, dw, None, None, None, None
