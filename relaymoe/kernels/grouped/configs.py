"""Tile configurations of the grouped kernels: the autotune candidates and keys, the pick of a
launch's meta-parameters (a shipped configuration, the autotuner, or a fixed one) and the scratch
allocator of tensor descriptors.
"""

from __future__ import annotations

import torch
import triton

from relaymoe.kernels import interpret_mode
from relaymoe.kernels.grouped.tiles import row_group_m
from relaymoe.kernels.tuned import OPTIONAL_CONFIG_KEYS, shipped_config


def _cfg(bm, bn, bk, warps, stages, **switches):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **switches},
                         num_warps=warps, num_stages=stages)  # fmt: skip


# Short lists that fit H100/H200 shared memory (228 KB); autotune time counts on the device.
UP_CONFIGS = [
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 64, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(128, 128, 64, 8, 4),
]
# The up-projection without a gate (one accumulator a tile): the gated candidates with BLOCK_N
# doubled, so a tile holds as many outputs and registers and reuses each gathered x tile for as
# many MMA columns as the gated tile's two halves do (the gated tiles on the one-accumulator
# kernel leave each x tile half as reused, and the gather is what this kernel pays for)
UP_SINGLE_CONFIGS = [
    _cfg(c.kwargs["BLOCK_M"], 2 * c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps,
         c.num_stages)
    for c in UP_CONFIGS
]  # fmt: skip
ROWS_CONFIGS = [
    _cfg(128, 128, 64, 4, 4),
    _cfg(128, 256, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(64, 128, 64, 4, 4),
]
WGRAD_CONFIGS = [
    # the fastest weight-gradient configuration, each timed alone, first (128x128x64, 8 warps,
    # 5 stages); larger tiles and 128- or 32-pair steps were slower and are left out
    _cfg(128, 128, 64, 8, 5),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 256, 64, 8, 3),
    _cfg(64, 128, 64, 4, 4),  # small M (narrow experts)
    # adding into fp32 main_grad at few pairs an expert (EP 1, one micro-batch), where the
    # accumulator's read and write bound the kernel: small tiles, the output tile read before
    # the pairs' loop (1x H200, 256 pairs an expert: dw2 1.17x faster than the same tiles
    # reading it after; dw13 slower, so both forms are candidates)
    _cfg(64, 128, 64, 4, 4, PRELOAD_C=True),
    _cfg(128, 64, 64, 4, 4, PRELOAD_C=True),
]
# Interpreter (CPU tests): small tiles so odd shapes cross tile edges.
_INTERP_CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}


# autotune keys: the shipped configurations (tuned.py) are looked up by the same names
UP_KEY = ("H", "I", "n_experts", "SAVE_H", "SCALE")
ROWS_KEY = ("N", "K", "n_experts", "A_GATHER")
# PAIRS: the launch's mean pairs an expert, rounded up to a power of two. The weight gradient's
# best tile depends on it: with few pairs an expert (one micro-batch at EP 1: 256) the fp32
# accumulator's traffic binds and small tiles win (64x128: 1.24x over 128x128, 1x H200), with
# many (2,048 at T32k) 128x128 does
WGRAD_KEY = ("M", "N", "A_GATHER", "B_GATHER", "ACCUMULATE", "PAIRS")


def single_tile_config(gated_config: dict | None) -> dict | None:
    """The up-projection's configuration without a gate, from the gated kernel's for the same
    key: BLOCK_N doubled (``UP_SINGLE_CONFIGS``' rule), the rest kept; None stays None."""
    if gated_config is None:
        return None
    return {**gated_config, "BLOCK_N": 2 * gated_config["BLOCK_N"]}


def pick_config(tuned, raw, config, kdim, name: str, key: dict, dtype, k, ncols: int | None = None):
    """The kernel and its meta-parameters. On GPU: the shipped configuration of (GPU, ``name``,
    bucket of the autotune ``key``) when ``kernels/tuned_configs.json`` has one, else the
    autotuner (``k.autotune``, ``tuned.py``). A fixed config (EVEN_K derived) under the
    interpreter, when a test passes one, or with ``autotune="first"`` (the first candidate).
    ``ncols``: a gathered-row kernel's output columns, for its GROUP_M (a config's own wins)."""
    if config is None and not interpret_mode():
        if k.autotune == "shipped":
            config = shipped_config(name, key, dtype)
        if config is None and k.autotune != "first":
            return tuned, {}
        if config is None:
            first = tuned.configs[0]
            config = {**first.kwargs, "num_warps": first.num_warps,
                      "num_stages": first.num_stages}  # fmt: skip
    cfg = dict(_INTERP_CFG if config is None else config)
    meta = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    meta.update({k: cfg[k] for k in OPTIONAL_CONFIG_KEYS if k in cfg})  # a candidate's switches
    for k in ("num_warps", "num_stages"):
        if k in cfg:
            meta[k] = cfg[k]
    if kdim is not None:
        meta["EVEN_K"] = kdim % meta["BLOCK_K"] == 0
    if ncols is not None:
        meta["GROUP_M"] = cfg.get("GROUP_M", row_group_m(ncols, meta["BLOCK_N"]))
    return raw, meta


def set_descriptor_allocator() -> None:
    """Give Triton an allocator for the descriptors' scratch in this thread, unless one is set.

    Triton keeps its allocator in a ``ContextVar``: one set in the forward's thread is not seen by
    autograd's backward thread, where the ring's per-hop recompute launches ``up_swiglu`` again.
    So this runs before every descriptor launch, not once per process. A user's own allocator is
    kept."""
    current = _triton_allocator()
    if current is not None and not isinstance(current, _NullAllocator):
        return
    triton.set_allocator(_torch_scratch)


def _torch_scratch(size: int, alignment: int, stream):
    # the caching allocator's blocks are 512-byte aligned, more than any descriptor asks
    return torch.empty(size, dtype=torch.int8, device="cuda")


try:  # where Triton keeps the allocator (3.4-3.8); without it every call sets ours
    from triton.runtime._allocation import NullAllocator as _NullAllocator
    from triton.runtime._allocation import _allocator as _TRITON_ALLOCATOR
except ImportError:  # pragma: no cover - a Triton that moved it
    _NullAllocator, _TRITON_ALLOCATOR = type(None), None


def _triton_allocator():
    return None if _TRITON_ALLOCATOR is None else _TRITON_ALLOCATOR.get()
