"""The one place that picks how an expert GEMM runs: Triton, Gluon or ``torch._grouped_mm``.

Every choice reads a :class:`relaymoe.options.KernelOptions` (``k``) and the operands' device,
dtype and strides; the kernels and launchers (``grouped/``, ``gather_ws.py``) hold no policy.
Each choice gives the same result up to rounding; the defaults are the ones measured fastest.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from relaymoe.activation import SWIGLU
from relaymoe.cost import hop_slice_pairs
from relaymoe.kernels import interpret_mode
from relaymoe.options import KernelOptions

__all__ = [
    "LONG_GROUP_PAIRS",
    "col_chunks",
    "gather_then_gmm",
    "gather_ws_for",
    "gather_ws_module",
    "gluon_up_computes",
    "hop_slice_rows",
    "kernel_options",
    "launch_ws",
    "pair_buffer_bytes",
    "tma_operand",
    "tma_weights",
    "use_torch_grouped_mm",
    "wgrad_by_gmm",
]

# Mean pairs per expert from which ``wgrad="auto"`` takes torch._grouped_mm over gathered column
# chunks for the weight gradients (below it the gathered-operand Triton kernel was faster).
LONG_GROUP_PAIRS = 8192


def kernel_options(k: KernelOptions | None) -> KernelOptions:
    """``k``, or the documented defaults (``KernelOptions()``) for None: the caller's value,
    else the default, never process state."""
    if k is None:
        return KernelOptions()
    if not isinstance(k, KernelOptions):
        raise ValueError(f"kernels={k!r} must be a relaymoe.options.KernelOptions or None")
    return k


def pair_buffer_bytes(k: KernelOptions) -> int:
    """The budget of any transient (P, chunk) pair buffer (``k.pair_buffer_mib``)."""
    return k.pair_buffer_mib * 2**20


def hop_slice_rows(k: KernelOptions, fc1_rows: int, ffn: int, hidden: int,
                   elt: int) -> int | None:  # fmt: skip
    """Pairs of one slice of a hop's compute under ``k.hop_slice_mib`` (None: never sliced):
    ``relaymoe.cost.hop_slice_pairs``, the memory model's own count, for experts of
    ``fc1_rows`` (J), ``ffn`` (I) and ``hidden`` (H) at ``elt`` bytes an element."""
    return hop_slice_pairs(k.hop_slice_mib * 2**20, fc1_rows, ffn, hidden, elt)


def col_chunks(n_pairs: int, ncols: int, elt: int, k: KernelOptions) -> list[tuple[int, int]]:
    """Column chunks of a (P, ncols) buffer under the pair-buffer budget, multiples of 256."""
    width = max(256, pair_buffer_bytes(k) // max(1, n_pairs * elt) // 256 * 256)
    return [(c, min(c + width, ncols)) for c in range(0, ncols, width)]


# ---------------------------------------------------------------------------------- torch gmm
def gmm_strides_ok(t: Tensor) -> bool:
    """torch._grouped_mm's operand rules: 16-byte aligned base, unit stride in one of the last two
    dims and a 16-byte multiple in the other."""
    align = 16 // t.element_size()
    s_row, s_col = t.stride(-2), t.stride(-1)
    if t.data_ptr() % 16:
        return False
    if s_col == 1:
        return s_row % align == 0
    return s_row == 1 and s_col % align == 0


def _sm90(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9


def use_torch_grouped_mm(a_PK: Tensor, b_EKN: Tensor, k: KernelOptions) -> bool:
    """``torch._grouped_mm`` for a contiguous-operand GEMM: bf16 on sm90 (its CUTLASS path), with
    strides it accepts and K, N multiples of 8; Triton otherwise or with ``dense_gemm="triton"``."""
    if k.dense_gemm == "triton":
        return False
    return (
        a_PK.dtype == torch.bfloat16
        and b_EKN.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and _sm90(a_PK)
        and b_EKN.shape[0] > 0
        and a_PK.shape[1] % 8 == 0
        and b_EKN.shape[2] % 8 == 0
        and gmm_strides_ok(a_PK)
        and gmm_strides_ok(b_EKN)
    )


def _gmm_wgrad_ok(a: Tensor, b: Tensor, c_EMN: Tensor) -> bool:
    """Where the grouped-GEMM weight gradient can run: torch's grouped GEMM exists for the device
    and dtype (CUTLASS on sm90 for bf16; torch's CPU implementation) and every operand, chunk and
    transpose keeps its 16-byte stride rule (M and N multiples of 16 bytes). ``c`` may be fp32
    (the ring's fp32 accumulators): each result is added into it in fp32."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype:
        return False
    if c_EMN.dtype not in (a.dtype, torch.float32):  # fp32: accumulators of 16-bit weights
        return False
    ok_dev = (a.dtype == torch.bfloat16 and _sm90(a)) if a.is_cuda else a.device.type == "cpu"
    align = 16 // a.element_size()
    _, m, n = c_EMN.shape
    # the contiguous operand goes to torch as is (transposed when it is ``a``): its own strides
    # and base must pass; the gathered one is copied into fresh, aligned chunks
    return (
        ok_dev
        and m % align == 0
        and n % align == 0
        and a.stride(1) == 1
        and b.stride(1) == 1
        and gmm_strides_ok(a)
        and gmm_strides_ok(b)
    )


def wgrad_by_gmm(a, b, c_ref, n_pairs: int, *, a_gather: bool, b_gather: bool,
                 k: KernelOptions) -> bool:  # fmt: skip
    """Whether a weight gradient ``c[e] = sum_q a[row]^T b[row]`` runs as K-grouped
    ``torch._grouped_mm`` over gathered column chunks: ``wgrad="gmm"`` wherever it runs, or
    ``"auto"`` on CUDA for long expert groups (``LONG_GROUP_PAIRS``), else the Triton kernel.
    ``c_ref``: the gradient or a tensor of its shape and dtype (a meta tensor will do)."""
    n_experts = c_ref.shape[0]
    long_groups = n_pairs >= LONG_GROUP_PAIRS * max(1, n_experts)
    wanted = k.wgrad == "gmm" or (k.wgrad == "auto" and a.is_cuda and long_groups)
    return (
        wanted
        and a_gather != b_gather
        and n_pairs > 0
        and n_experts > 0
        and _gmm_wgrad_ok(a, b, c_ref)
    )


def gather_then_gmm(x_TK: Tensor, w_EKN: Tensor, n_pairs: int, k: KernelOptions) -> bool:
    """Whether the gathered-row GEMM ``x[tok[q]] @ w[e]`` runs as one gathered (P, K) copy and
    ``torch._grouped_mm`` (``rows_gather="copy"``) instead of a gather-on-load kernel
    (``"index"``, the default: no (P, H) copy). The copy must fit the pair-buffer budget in one
    piece (no host sync to split it by experts)."""
    if k.rows_gather != "copy" or n_pairs == 0 or not hasattr(torch, "_grouped_mm"):
        return False
    if n_pairs * x_TK.shape[1] * x_TK.element_size() > pair_buffer_bytes(k):
        return False
    if x_TK.device.type == "cpu":
        return x_TK.dtype == w_EKN.dtype
    return use_torch_grouped_mm(x_TK, w_EKN, k)


# --------------------------------------------------------------------------- tensor descriptors
@functools.cache
def _sm90_with_descriptors(device_index: int | None) -> bool:
    import triton.language as tl

    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _tma_wanted(t: Tensor, k: KernelOptions) -> bool:
    """``k.tma``: ``auto`` (on for CUDA tensors of an sm90 GPU, where it was measured faster,
    when Triton has tensor descriptors), ``on`` (always) or ``off`` (never)."""
    if k.tma == "auto":
        return t.is_cuda and _sm90_with_descriptors(t.device.index)
    return k.tma == "on"


def tma_operand(t: Tensor, k: KernelOptions) -> bool:
    """Whether a 2-D operand (rows, cols) is read through a tensor descriptor: asked for
    (``k.tma``), unit column stride, 16-byte aligned base and row stride."""
    if not _tma_wanted(t, k):
        return False
    elt = t.element_size()
    return not (t.stride(1) != 1 or (t.stride(0) * elt) % 16 or t.data_ptr() % 16)


def tma_weights(w_EMK: Tensor, k: KernelOptions) -> bool:
    """Whether ``up_swiglu`` loads ``w13`` through a tensor descriptor over its (El*2I, H) rows:
    asked for, and a contiguous weight whose rows :func:`tma_operand` takes."""
    return w_EMK.is_contiguous() and tma_operand(w_EMK.view(-1, w_EMK.shape[-1]), k)


# ------------------------------------------------------------------------------- Gluon kernels
@functools.cache
def gather_ws_module():
    """``(module, None)`` or ``(None, reason)``: Gluon is experimental, and a Triton without it,
    or with another API, keeps the Triton kernel."""
    try:
        from relaymoe.kernels import gather_ws
    except Exception as exc:  # ImportError, or a Gluon whose names moved
        return None, f"relaymoe.kernels.gather_ws does not import: {exc!r}"
    return gather_ws, None


# kinds whose Gluon kernel failed to build on this Triton -> the reason (the Triton kernels run)
GATHER_WS_UNBUILT: dict[str, str] = {}


def gluon_up_computes(activation, bias, a_out) -> bool:
    """Whether the Gluon up-projection computes this call: its storer adds no fc1 bias and
    computes SwiGLU's ``silu(gate) * up`` only (``gather_ws._tile_storer``), so it takes a gated
    fc1 without bias, and of the activations SwiGLU's, unless ``a`` is not stored (``a_out`` None:
    the fc1 recompute stores h alone, the same for every gated activation). Everything else
    runs the Triton kernel, whose epilogue computes every activation and the bias."""
    act = SWIGLU if activation is None else activation
    return bias is None and act.gated and (a_out is None or act == SWIGLU)


def gather_ws_for(kind: str, x_TK: Tensor, *operands, k: KernelOptions, activation=None,
                  bias=None):  # fmt: skip
    """The Gluon module when it takes this gathered GEMM (``kind``: ``up_swiglu`` or
    ``rows_gemm``, whose ``supports_<kind>`` gets ``x_TK`` and ``operands``: the weight, then the
    outputs; ``k.gather_ws``), else None. ``up_swiglu``: also ``activation`` (None: SwiGLU)
    and ``bias`` (the fc1 bias or None), which :func:`gluon_up_computes` must take."""
    if k.gather_ws == "off" or not x_TK.is_cuda or interpret_mode():
        return None
    a_out = operands[2] if len(operands) > 2 else None  # (w13, h, a) of the up-projection
    if kind == "up_swiglu" and not gluon_up_computes(activation, bias, a_out):
        return None
    if not _sm90(x_TK):
        return None
    module, _ = gather_ws_module()
    if module is None or kind in GATHER_WS_UNBUILT:
        return None
    if not getattr(module, f"supports_{kind}")(x_TK, *operands):
        return None
    return module


def _build_failure(exc: BaseException) -> bool:
    """A failure to build a kernel (raised at launch, before any work is queued): Triton's own
    errors (compilation, ptxas, resources) and an MLIR pass failure. Anything else propagates."""
    from triton.errors import TritonError

    return isinstance(exc, TritonError) or (
        isinstance(exc, RuntimeError) and "PassManager" in str(exc)
    )


def launch_ws(kind: str, launch) -> bool:
    """Run the Gluon ``launch`` of ``kind``. If this Triton cannot build it (Gluon's API moves
    between releases), remember why, warn once, and return False: the caller runs the Triton
    kernel, now and for every later call of that kind."""
    try:
        launch()
    except Exception as exc:
        if not _build_failure(exc):
            raise
        import triton

        GATHER_WS_UNBUILT[kind] = f"{type(exc).__name__}: {str(exc)[:300]}"
        warnings.warn(
            f"relaymoe: the Gluon {kind} kernel does not build on Triton {triton.__version__} "
            f"({GATHER_WS_UNBUILT[kind]}); the Triton kernel runs instead "
            '(KernelOptions(gather_ws="off") skips the attempt)',
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True
