"""The routing index's four arrays: their shapes and dtypes, and the check of arrays a build is
handed to write in place. Torch only, so that the plain-torch build and the Triton launcher
share the one definition."""

from __future__ import annotations

import torch

__all__ = ["check_index_out", "index_arrays_like"]


def index_arrays_like(num_pairs: int, num_experts: int) -> tuple[tuple[tuple, torch.dtype], ...]:
    """``(shape, dtype)`` of the routing index's four arrays, in ``RoutingIndex`` field order:
    ``expert_token_indices (P,)`` int32, ``expert_token_offsets (E+1,)`` int64,
    ``token_expert_indices (P,)`` int32, ``token_index_map (P,)`` int32, int64 once P >= 2**31
    (it holds pair positions)."""
    map_dtype = torch.int64 if num_pairs >= 2**31 else torch.int32
    return (((num_pairs,), torch.int32), ((num_experts + 1,), torch.int64),
            ((num_pairs,), torch.int32), ((num_pairs,), map_dtype))  # fmt: skip


def check_index_out(out, num_pairs: int, num_experts: int, device) -> None:
    """ValueError unless ``out`` is four contiguous tensors of :func:`index_arrays_like`'s
    shapes and dtypes on ``device`` (what a build writes in place)."""
    want = index_arrays_like(num_pairs, num_experts)
    if len(out) != 4:
        raise ValueError(f"out must be the index's 4 arrays, got {len(out)}")
    for i, (t, (shape, dt)) in enumerate(zip(out, want, strict=True)):
        if tuple(t.shape) != shape or t.dtype != dt or t.device != device or not t.is_contiguous():
            raise ValueError(
                f"out[{i}] must be a contiguous {dt} tensor of shape {shape} on {device}, got "
                f"{t.dtype} {tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()}); "
                "allocate it with index_arrays_like"
            )
