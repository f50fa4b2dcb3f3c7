"""A torch stand-in for apex's ``fused_weight_gradient_mlp_cuda``, so that Megatron's
``--gradient-accumulation-fusion`` (its default) runs where apex is not installed.

With gradient-accumulation fusion, Megatron's own linear layers (``ColumnParallelLinear``,
``RowParallelLinear``: the output layer and the local layers) add each weight gradient into the
parameter's fp32 ``main_grad`` inside one GEMM, through apex's extension; TransformerEngine's
layers do the same with their own GEMMs. Without the extension megatron-core refuses the flag
at layer construction, so a run must pass ``--no-gradient-accumulation-fusion``, and every
micro-batch then pays one ``main_grad.add_(grad)`` per parameter in DDP's hook (on a 4-layer
128-expert slice at global batch 16: 16,880 adds and about a quarter of the GPU time of a
graphed step). Users on NVIDIA's containers have apex and the fused path; this module gives the
same to a plain ``pip install megatron-core``.

``wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)`` computes
``main_grad += grad_output.T @ total_input`` with the product accumulated in ``main_grad``'s
dtype, as apex's does: one GEMM with an fp32 output and beta = 1 where torch offers it
(``relaymoe.loss.chunk.accumulate_wgrad`` picks the way once per device). ``_fp16`` is the same
for a half-precision ``main_grad``.

``install()`` is called by ``relaymoe.megatron.register()`` and does nothing when the real
extension imports: apex always wins. It only turns megatron-core's refusal to build (the flag
on, the extension missing) into a run; ``--no-gradient-accumulation-fusion`` still turns the
fusion off.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types

from torch import Tensor

logger = logging.getLogger("relaymoe.megatron")

__all__ = ["MODULE", "install", "wgrad_gemm_accum_fp16", "wgrad_gemm_accum_fp32"]

MODULE = "fused_weight_gradient_mlp_cuda"  # apex's extension, as megatron-core imports it


def _accumulate(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    from relaymoe.loss.chunk import accumulate_wgrad

    if total_input.dim() != 2 or grad_output.dim() != 2:  # megatron-core passes 2-D; be safe
        total_input = total_input.reshape(-1, total_input.shape[-1])
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
    if tuple(main_grad.shape) != (grad_output.shape[1], total_input.shape[1]):
        raise ValueError(
            f"{MODULE} (relaymoe's fallback): main_grad of shape {tuple(main_grad.shape)} does "
            f"not match grad_output {tuple(grad_output.shape)} and input "
            f"{tuple(total_input.shape)}: it must be (grad_output columns, input columns)"
        )
    accumulate_wgrad(main_grad, grad_output, total_input)


def wgrad_gemm_accum_fp32(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad (fp32) += grad_output.T @ total_input`` (apex's signature)."""
    _accumulate(total_input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad (fp16/bf16) += grad_output.T @ total_input`` (apex's signature)."""
    _accumulate(total_input, grad_output, main_grad)


def install() -> bool:
    """Make ``import fused_weight_gradient_mlp_cuda`` give this module's functions when apex's
    extension is missing, and tell an already imported ``megatron.core.tensor_parallel.layers``
    that it is available. Returns True when the fallback is in use."""
    current = sys.modules.get(MODULE)
    if current is not None and getattr(current, "__relaymoe_fallback__", False):
        return True
    try:
        importlib.import_module(MODULE)
        return False  # apex's own
    except ImportError:
        pass
    shim = types.ModuleType(MODULE)
    shim.__doc__ = __doc__
    shim.__relaymoe_fallback__ = True
    shim.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    shim.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    sys.modules[MODULE] = shim
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    if layers is not None:  # imported before us: it recorded the extension as missing
        layers.fused_weight_gradient_mlp_cuda = shim
        layers._grad_accum_fusion_available = True
    logger.info(
        "apex's %s is not installed: gradient-accumulation fusion uses relaymoe's torch "
        "fallback (one fp32-output GEMM into main_grad)",
        MODULE,
    )
    return True
