"""What one chunk of tokens computes: row statistics, the TP combine, logits gradient, weight grad.

The statistics and the logits gradient run in torch or in the Triton row kernels
(``relaymoe.kernels.cross_entropy``, imported on first use); the combine makes Megatron's
all-reduces; the weight gradient accumulates in fp32 (``accumulate_wgrad``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from relaymoe.loss.inputs import LossSetup


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


def chunk_stats(logits_CV, tgt_C, setup: LossSetup):
    want_sum = setup.smoothing > 0
    if setup.impl == "triton":
        from relaymoe.kernels.cross_entropy import row_stats

        return row_stats(logits_CV, tgt_C, want_sum=want_sum)
    return _stats_torch(logits_CV, tgt_C, want_sum, setup.work)


def chunk_grad(logits_CV, tgt_C, lse_C, scale_C, setup: LossSetup) -> Tensor:
    """The chunk's logits gradient, written over ``logits_CV`` (returned)."""
    smooth = setup.smoothing / setup.vocab_local
    target_weight = 1.0 - setup.smoothing
    if setup.impl == "triton":
        from relaymoe.kernels.cross_entropy import row_grad

        return row_grad(logits_CV, tgt_C, lse_C, scale_C, smooth=smooth,
                        target_weight=target_weight)  # fmt: skip
    return _grad_torch(logits_CV, tgt_C, lse_C, scale_C, smooth, target_weight, setup.work)


def combine_stats(rowmax, sumexp, target, rowsum, has_target, setup: LossSetup):
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


def accumulate_wgrad(acc_VH: Tensor, dlogits_CV: Tensor, h_CH: Tensor) -> None:
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
