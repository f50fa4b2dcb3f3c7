"""Shipped kernel configurations: the autotuner's pick per GPU, kernel and shape bucket.

A process autotunes each grouped-GEMM kernel once per autotune key, compiling and timing every
candidate (4 to 9 per kernel), which on a fresh machine with an empty Triton cache makes the
first call take minutes. With a shipped configuration for (GPU name, kernel, bucket) a launcher
compiles that one configuration and skips the search.

The table is package data (``tuned_configs.json`` beside this file)::

    {"version": 1,
     "gpus": {"NVIDIA H200": {"up_swiglu": {"<bucket>": {"BLOCK_M": 128, ..., "num_warps": 8,
                                                         "num_stages": 3}, ...}, ...}},
     "provenance": {"NVIDIA H200": {"commit": ..., "torch": ..., "triton": ..., "date": ...}}}

A bucket is the kernel's autotune key with every size rounded up to a power of two (sizes within
a factor of two share a configuration) and the activations' dtype, e.g.
``H=2048,I=1024,n_experts=64,SAVE_H=1,SCALE=1,bfloat16``. Regenerate on the target GPU with
``python benchmarks/tune_kernels.py`` from a checkout of the repository (it autotunes representative shapes and merges the winners
into the table under that GPU's name).

``KernelOptions.autotune`` chooses: ``shipped`` (default: the shipped configuration when the
table has one for this GPU and bucket, else the autotuner), ``search`` (always the autotuner),
``first`` (the kernel's first candidate, no search).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

__all__ = ["OPTIONAL_CONFIG_KEYS", "TABLE", "bucket", "load_table", "pow2_bucket", "shipped_config"]

TABLE = Path(__file__).with_name("tuned_configs.json")
VERSION = 1
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
# a kernel's own switches that some of its candidates set (absent: the kernel's default)
OPTIONAL_CONFIG_KEYS = ("PRELOAD_C",)


def pow2_bucket(n: int) -> int:
    """``n`` rounded up to a power of two (1 for n <= 1): the size rounding of every bucket,
    and of a launcher's key values that must not start a new search for every size."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def bucket(key: dict, dtype) -> str:
    """The bucket of an autotune key (name -> int or bool, in the kernel's key order) for
    activations of ``dtype`` (a torch dtype or its name)."""
    parts = []
    for name, value in key.items():
        if isinstance(value, bool):
            parts.append(f"{name}={int(value)}")
        else:
            parts.append(f"{name}={pow2_bucket(int(value))}")
    parts.append(str(dtype).removeprefix("torch."))
    return ",".join(parts)


def _check_table(table: dict, where: str) -> dict:
    if not isinstance(table, dict) or table.get("version") != VERSION:
        raise ValueError(
            f"{where}: not a version-{VERSION} tuned-configuration table; regenerate it with "
            "python benchmarks/tune_kernels.py"
        )
    for gpu, kernels in table.get("gpus", {}).items():
        for kernel, buckets in kernels.items():
            for b, cfg in buckets.items():
                if not set(_CONFIG_KEYS) <= set(cfg) <= {*_CONFIG_KEYS, *OPTIONAL_CONFIG_KEYS}:
                    raise ValueError(
                        f"{where}: {gpu} / {kernel} / {b} has keys {sorted(cfg)}; a configuration "
                        f"needs exactly {list(_CONFIG_KEYS)}, and may add "
                        f"{list(OPTIONAL_CONFIG_KEYS)}"
                    )
    return table


@functools.lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict:
    """The table at ``path`` (default: the shipped one), checked; read once per process (tests
    that swap it clear this cache and ``_lookup``'s)."""
    p = Path(path) if path else TABLE
    if not p.exists():
        return {"version": VERSION, "gpus": {}}
    return _check_table(json.loads(p.read_text()), str(p))


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def shipped_config(kernel: str, key: dict, dtype, *, gpu: str | None = None) -> dict | None:
    """The shipped configuration of ``kernel`` for this autotune ``key`` on ``gpu`` (default:
    the current CUDA device's name), or None. Called at every launch: the lookups are cached."""
    if gpu is None:
        import torch

        if not torch.cuda.is_available():
            return None
        gpu = _device_name(torch.cuda.current_device())
    cfg = _lookup(gpu, kernel, tuple(key.items()), str(dtype))
    return dict(cfg) if cfg is not None else None


@functools.lru_cache(maxsize=1024)
def _lookup(gpu: str, kernel: str, key: tuple, dtype: str) -> dict | None:
    kernels = load_table().get("gpus", {}).get(gpu)
    if not kernels:  # nothing shipped for this GPU: no bucket to compute
        return None
    return kernels.get(kernel, {}).get(bucket(dict(key), dtype))
