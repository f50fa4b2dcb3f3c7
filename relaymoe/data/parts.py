"""One chunk's part dataset: made by a worker under a temporary name, with a sidecar, then kept.

A part counts once its sidecar (what it was made from) is renamed into place; a rerun keeps
every part whose sidecar matches (``part_done``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from relaymoe.data.errors import DataError
from relaymoe.data.inputs import Chunk, documents
from relaymoe.data.tokenizer import build_megatron_tokenizer

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Settings:
    keys: tuple[str, ...]
    text_mode: str
    append_eod: bool
    tokenizer_dir: str
    tokenizer_sha256: str
    eod: int | None
    vocab_size: int
    dtype: str


def _sidecar(chunk: Chunk, settings: Settings) -> dict:
    return {"format": FORMAT_VERSION, "chunk": asdict(chunk), "settings": asdict(settings)}


def same_json(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def part_prefix(parts_dir: Path, chunk: Chunk, key: str) -> Path:
    return parts_dir / f"{chunk.name}_{key}"


def part_done(parts_dir: Path, chunk: Chunk, settings: Settings) -> bool:
    meta = parts_dir / f"{chunk.name}.json"
    if not meta.is_file():
        return False
    try:
        recorded = json.loads(meta.read_text())
    except json.JSONDecodeError:
        return False
    if not same_json(
        {k: v for k, v in recorded.items() if k != "stats"}, _sidecar(chunk, settings)
    ):
        return False
    return all(
        Path(f"{part_prefix(parts_dir, chunk, k)}{ext}").is_file()
        for k in settings.keys
        for ext in (".bin", ".idx")
    )


_WORKER: dict = {}


def worker_init(tokenizer_dir: str, counter, setup=None) -> None:
    """A process that makes parts: ``setup()`` first (the caller's, e.g. its warning filters),
    then the tokenizer of ``tokenizer_dir``, loaded once per process; ``counter``: the shared
    count of input bytes done (for the progress), or None."""
    if setup is not None:
        setup()
    if _WORKER.get("tokenizer_dir") != tokenizer_dir:  # loaded once per process
        _WORKER["tokenizer"] = build_megatron_tokenizer(tokenizer_dir)
        _WORKER["tokenizer_dir"] = tokenizer_dir
    _WORKER["counter"] = counter


def worker_tokenizer(tokenizer_dir: str):
    """This process's tokenizer of ``tokenizer_dir`` (loaded once per process), with no counter."""
    worker_init(tokenizer_dir, None)
    return _WORKER["tokenizer"]


def make_part(parts_dir: str, chunk: Chunk, settings: Settings) -> dict:
    """Tokenise one chunk into its part datasets (one per key); returns its statistics."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if _WORKER.get("tokenizer_dir") != settings.tokenizer_dir:
        worker_init(settings.tokenizer_dir, _WORKER.get("counter"))
    tok = _WORKER["tokenizer"]
    counter = _WORKER.get("counter")
    dtype = getattr(numpy, settings.dtype)
    folder = Path(parts_dir)
    tmp = {k: Path(f"{part_prefix(folder, chunk, k)}.tmp{os.getpid()}") for k in settings.keys}
    builders = {k: IndexedDatasetBuilder(f"{tmp[k]}.bin", dtype=dtype) for k in settings.keys}
    stats = {"documents": 0, "empty": 0, "tokens": {k: 0 for k in settings.keys}}
    last = chunk.start
    for doc, pos in documents(chunk, settings.keys, settings.text_mode):
        if counter is not None and pos > last:
            with counter.get_lock():
                counter.value += pos - last
            last = pos
        if not doc or not any(doc[k].strip() for k in settings.keys):
            stats["empty"] += 1
            continue
        for k in settings.keys:
            ids = list(tok.tokenize(doc[k]))
            if settings.append_eod:
                ids.append(settings.eod)
            if ids and max(ids) >= settings.vocab_size:
                raise DataError(
                    f"token id {max(ids)} from {chunk.path} is outside the tokenizer's "
                    f"vocabulary of {settings.vocab_size}"
                )
            builders[k].add_document(ids, [len(ids)])
            stats["tokens"][k] += len(ids)
        stats["documents"] += 1
    if counter is not None and chunk.end > last:
        with counter.get_lock():
            counter.value += chunk.end - last
    for k, b in builders.items():
        b.finalize(f"{tmp[k]}.idx")
        final = part_prefix(folder, chunk, k)
        os.replace(f"{tmp[k]}.bin", f"{final}.bin")
        os.replace(f"{tmp[k]}.idx", f"{final}.idx")
    meta = dict(_sidecar(chunk, settings), stats=stats)
    tmp_meta = folder / f"{chunk.name}.json.tmp{os.getpid()}"
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, folder / f"{chunk.name}.json")  # the part counts only from here on
    return stats


def make_part_star(args):
    return make_part(*args)
