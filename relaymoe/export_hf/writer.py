"""A Hugging Face checkpoint's safetensors shards and their index, written as tensors come.

The layout ``save_pretrained`` writes and every loader reads: ``model-0000K-of-0000N.safetensors``
files of at most ``max_shard_bytes`` each (one tensor larger than that gets a file of its own)
and ``model.safetensors.index.json`` mapping each tensor to its file; a single shard is
``model.safetensors`` without an index. The number of shards is known only at the end, so the
shards are written under provisional names and renamed by ``close``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

INDEX = "model.safetensors.index.json"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    """Bytes of ``5GB``, ``500MB``, ``2GiB`` or a plain number; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is no size (e.g. 5GB, 500MB, 2GiB or bytes)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


class ShardWriter:
    """``add`` tensors in the order they should be stored, then ``close`` (returns the weight
    map: tensor name -> file)."""

    def __init__(self, folder: Path, max_shard_bytes: int):
        self.folder = folder
        self.max_bytes = max_shard_bytes
        self.pending: dict = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []  # the tensor names of each written shard
        self.total_bytes = 0

    def add(self, name: str, tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, str(self._provisional(len(self.files))), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _provisional(self, k: int) -> Path:
        return self.folder / f"part-{k:05d}.safetensors"

    def close(self) -> dict[str, str]:
        if self.pending:
            self._flush()
        n = len(self.files)
        weight_map = {}
        for k, names in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            self._provisional(k).rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map
