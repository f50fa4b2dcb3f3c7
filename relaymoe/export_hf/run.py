"""``export``: a Megatron ``torch_dist`` checkpoint written as a Hugging Face Qwen3-MoE folder.

No model is built and no process group started: the checkpoint's global tensors are read one
decoder layer at a time (``checkpoint.TorchDistCheckpoint.read``), renamed and split through the
table convert-hf uses (``tensors``), and written as safetensors shards (``writer``) beside a
``config.json`` made from the run's saved arguments (``architecture``). Host memory: one layer
of the checkpoint plus one shard (``max_shard_size``).

The folder is written under a temporary name beside ``out`` and renamed when complete, so a
failed export leaves nothing that looks like a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from relaymoe.convert_hf.errors import ConvertError
from relaymoe.convert_hf.hf_config import architecture_differences, read_hf_config
from relaymoe.convert_hf.mapping import GLOBAL_TENSORS, hf_names
from relaymoe.export_hf.architecture import hf_config
from relaymoe.export_hf.checkpoint import TorchDistCheckpoint
from relaymoe.export_hf.errors import ExportError
from relaymoe.export_hf.tensors import Layout, global_tensors, layer_tensors
from relaymoe.export_hf.writer import ShardWriter, parse_size

DTYPES = ("auto", "bf16", "fp16", "fp32")
_TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# what a base folder contributes besides config.json's token ids: the tokenizer, generation
BASE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)
# config.json keys another transformers generation writes for what the exported keys say
_ALTERNATE_KEYS = ("num_local_experts", "rope_parameters", "dtype", "transformers_version")


def export(
    load: str,
    out: str,
    *,
    iteration: int | None = None,
    dtype: str = "auto",
    max_shard_size: str = "5GB",
    base: str | None = None,
) -> dict:
    """Export; returns a summary (``folder``, ``tensors``, ``shards``, ``bytes``, ``dtype``,
    ``iteration_folder``). ExportError for a checkpoint or setting it cannot export."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}; known: {DTYPES}")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise ExportError(f"--max-shard-size: {e}") from None
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"--out {out} exists; pass a new folder (an export never overwrites)")
    ckpt = TorchDistCheckpoint(load, iteration)
    embedding = "embedding.word_embeddings.weight"
    if embedding not in ckpt.tensors:
        raise ExportError(f"{ckpt.folder} has no {embedding}: not a GPT model's checkpoint")
    stored = ckpt.tensors[embedding].properties.dtype
    name = {v: k for k, v in _torch_dtypes().items()}.get(stored, "fp32")
    written = name if dtype == "auto" else dtype
    # the arguments first (what Qwen3-MoE cannot express, by name), then where every tensor is
    cfg = hf_config(ckpt.args, ckpt.tensors[embedding].size[0], _TORCH_DTYPE_NAMES[written])
    layout = Layout(ckpt, cfg["num_hidden_layers"], cfg["num_experts"])
    base_cfg = _base_config(base, cfg) if base is not None else {}
    partial = target.parent / f".{target.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        summary = _write(ckpt, layout, cfg, partial, _torch_dtypes()[written], max_bytes)
        (partial / "config.json").write_text(json.dumps({**base_cfg, **cfg}, indent=2) + "\n")
        for f in BASE_FILES if base is not None else ():
            if (Path(base) / f).is_file():
                shutil.copy2(Path(base) / f, partial / f)
        if target.exists():
            target.rmdir()  # an empty folder, checked above
        partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {
        **summary,
        "folder": str(target),
        "dtype": written,
        "iteration_folder": str(ckpt.folder),
    }


def _torch_dtypes() -> dict:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _base_config(base: str, cfg: dict) -> dict:
    """The keys of ``base``'s config.json that the export does not write (token ids and the
    like), after checking that ``base`` is the checkpoint's architecture."""
    if not Path(base, "config.json").is_file():
        raise ExportError(
            f"--base {base}: no config.json; pass the Hugging Face folder the run "
            "started from (config.json, tokenizer files), or leave --base out"
        )
    try:
        raw = read_hf_config(base)
    except ConvertError as e:
        raise ExportError(f"--base: {e}") from None
    diff = architecture_differences(raw, cfg, ("base", "checkpoint"))
    if diff:
        raise ExportError(
            f"--base {base} is not the checkpoint's architecture ({'; '.join(diff)});"
            " fix: pass the folder the run started from, or leave --base out"
        )
    return {k: v for k, v in raw.items() if k not in cfg and k not in _ALTERNATE_KEYS}


def _write(ckpt, layout: Layout, cfg: dict, folder: Path, dtype, max_bytes: int) -> dict:
    """Every tensor, in ``hf_names`` order, into ``folder``'s shards; ExportError unless exactly
    the tensors of a Qwen3-MoE of ``cfg`` came out of the checkpoint."""
    expected = hf_names(cfg)
    writer = ShardWriter(folder, max_bytes)
    written: set[str] = set()

    def add(tensors: dict) -> None:
        for name in [n for n in expected if n in tensors and n not in written]:
            writer.add(name, tensors[name].to(dtype=dtype, copy=True).contiguous())
            written.add(name)

    top = global_tensors(ckpt, layout)
    hf_top = {
        GLOBAL_TENSORS[k]: v
        for k, v in top.items()
        if not (k == "output_layer.weight" and cfg["tie_word_embeddings"])
    }
    add(
        {k: v for k, v in hf_top.items() if k == GLOBAL_TENSORS["embedding.word_embeddings.weight"]}
    )
    for i in range(cfg["num_hidden_layers"]):
        tensors = layer_tensors(ckpt, layout, i, cfg)
        extra = sorted(set(tensors) - set(expected))
        if extra:
            raise ExportError(
                f"layer {i} has tensors a Qwen3-MoE of this config.json lacks: "
                f"{extra[:4]} (dense and MoE layers as --moe-layer-freq says?)"
            )
        add(tensors)
    add(hf_top)
    missing = [n for n in expected if n not in written]
    if missing:
        raise ExportError(
            f"the checkpoint lacks {len(missing)} tensor(s) a Qwen3-MoE of its arguments has, "
            f"e.g. {missing[:4]}: saved incompletely, or with other arguments than it holds"
        )
    weight_map = writer.close()
    return {
        "tensors": len(weight_map),
        "shards": len(set(weight_map.values())),
        "bytes": writer.total_bytes,
    }
