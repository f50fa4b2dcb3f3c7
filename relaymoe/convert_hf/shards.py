"""Lazy access by name to the tensors of a Hugging Face checkpoint's safetensors shards."""

from __future__ import annotations

import json
from pathlib import Path

from relaymoe.convert_hf.errors import ConvertError


class SafetensorsCheckpoint:
    """Lazy access to the tensors of a Hugging Face checkpoint folder, by name."""

    def __init__(self, hf_dir: str):
        try:
            from safetensors import safe_open
        except ImportError:
            raise ConvertError(
                "relaymoe convert-hf reads safetensors shards: pip install 'relaymoe[data]' "
                "(or safetensors)"
            ) from None
        self._open = safe_open
        folder = Path(hf_dir)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.where = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            with safe_open(str(folder / "model.safetensors"), "pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ConvertError(
                f"--hf {hf_dir}: no model.safetensors.index.json or model.safetensors (only "
                "safetensors checkpoints are read; re-save a .bin one with save_pretrained)"
            )
        missing = sorted({f for f in self.where.values() if not (folder / f).is_file()})
        if missing:
            raise ConvertError(
                f"--hf {hf_dir}: shard(s) {missing[:3]} named in the index are absent"
            )
        self.folder = folder
        self._files: dict = {}
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str):
        if name not in self.where:
            raise ConvertError(f"the checkpoint has no tensor {name!r} (a Qwen3-MoE one has)")
        shard = self.where[name]
        if shard not in self._files:
            self._files[shard] = self._open(str(self.folder / shard), "pt").__enter__()
        self.used.add(name)
        return self._files[shard].get_tensor(name)

    def close(self) -> None:
        for f in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()
