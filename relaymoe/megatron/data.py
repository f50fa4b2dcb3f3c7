"""``relaymoe data``: JSON lines or plain text to Megatron's indexed dataset (``.bin``/``.idx``).

What Megatron-LM's ``tools/preprocess_data.py --append-eod`` makes, without a Megatron-LM
checkout: every document is tokenised by the tokenizer that training will build from
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`` (megatron-core's own
``build_tokenizer``, so the ids, the vocabulary size and the EOD id are training's), the EOD id
is appended, and the documents are written through megatron-core's ``IndexedDatasetBuilder``
into ``PREFIX_{key}_document.bin``/``.idx`` (one dataset per JSON key, preprocess_data's names).

The inputs are cut into chunks (``--chunk-mib`` of JSON lines or text lines, a line belonging to
the chunk it starts in; a paragraph- or file-document input is one chunk). Each chunk is
tokenised by one worker process into a part dataset of its own, written under a temporary name
and renamed when complete, with a sidecar naming what it was made from (the input's path, size
and modification time, the chunk's byte range, the tokenizer files' hash, the settings). A
rerun keeps every part whose sidecar matches and makes only the missing ones, so an
interrupted run continues where it stopped; the parts are then merged in input order, which
makes the output independent of the worker count. A completed output has a manifest
(``PREFIX_{key}_document.json``, which also records the Megatron flags to train with); when it
matches, nothing is redone.

Megatron-core is imported by the functions, never at import time (``relaymoe`` CLI stays cheap).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT_VERSION = 1
TEXT_MODES = ("line", "paragraph", "file")
INPUT_FORMATS = ("auto", "jsonl", "text")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# the files of a Hugging Face tokenizer directory that decide its ids (hashed into the sidecars)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
)


class DataError(ValueError):
    """A bad input, tokenizer or setting of ``relaymoe data`` (the message names the fix)."""


# ------------------------------------------------------------------------------- tokenizer
# What megatron.core.tokenizers.utils.build_tokenizer passes for --tokenizer-type
# HuggingFaceTokenizer with every other tokenizer flag at Megatron's default (megatron-core
# 0.19.2); tests/test_data.py checks the ids against build_tokenizer on Megatron's parsed args.
# Building it here avoids importing megatron.training (seconds per process).
_HF_TOKENIZER_KWARGS = {
    "chat_template": None,
    "vocab_file": None,
    "merges_file": None,
    "additional_special_tokens": [],
    "use_fast": True,
    "trust_remote_code": False,
    "include_special_tokens": True,
}


def build_megatron_tokenizer(tokenizer_dir: str):
    """The tokenizer training builds from ``--tokenizer-type HuggingFaceTokenizer
    --tokenizer-model DIR``: megatron-core's ``MegatronTokenizer`` of the ``huggingface``
    library, with ``build_tokenizer``'s defaults."""
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked from here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise DataError(
                "relaymoe data needs the transformers package for Megatron's "
                "HuggingFaceTokenizer; fix: pip install 'relaymoe[data]' (or transformers)"
            ) from None
        from megatron.core.tokenizers import MegatronTokenizer

        try:
            return MegatronTokenizer.from_pretrained(
                tokenizer_path=tokenizer_dir,
                metadata_path={"library": "huggingface"},
                **_HF_TOKENIZER_KWARGS,
            )
        except ValueError as e:
            raise DataError(
                f"the tokenizer at {tokenizer_dir} does not load as Megatron's "
                f"HuggingFaceTokenizer ({e}); fix: pass a local directory holding a Hugging Face "
                "tokenizer (tokenizer.json and tokenizer_config.json, e.g. the Qwen3 checkpoint "
                "folder), or a tokenizer.json with --eod-token"
            ) from None


def resolve_tokenizer(path: str, *, output_prefix: str, eod_token: str | None) -> str:
    """The directory to pass as ``--tokenizer-model``: ``path`` itself when it is a tokenizer
    directory; for a ``tokenizer.json`` file, a directory ``PREFIX_tokenizer/`` made beside the
    output with that file and a ``tokenizer_config.json`` naming ``eod_token`` as the EOS token
    (Megatron's HuggingFaceTokenizer takes its EOD from it)."""
    p = Path(path)
    if p.is_dir():
        if eod_token is not None:
            raise DataError(
                f"--eod-token {eod_token!r} with the tokenizer directory {path}: its EOD is its "
                "tokenizer_config.json's eos_token, which training reads too; drop --eod-token, "
                "or set eos_token in that file"
            )
        return str(p.resolve())
    if not p.is_file():
        raise DataError(
            f"--tokenizer {path}: no such file or directory; fix: a local Hugging Face tokenizer "
            "directory (e.g. a downloaded Qwen/Qwen3-30B-A3B folder) or a tokenizer.json"
        )
    try:
        spec = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"--tokenizer {path}: not a tokenizer.json (not JSON: {e})") from None
    if not isinstance(spec, dict) or "model" not in spec:
        raise DataError(
            f"--tokenizer {path}: not a tokenizers tokenizer.json (no 'model' entry); pass a "
            "tokenizer directory or the tokenizer.json that the tokenizers library saves"
        )
    if eod_token is None:
        raise DataError(
            f"--tokenizer {path} is a bare tokenizer.json, which names no EOS token; fix: add "
            "--eod-token TOKEN (e.g. '<|endoftext|>', a token of its vocabulary), or pass a "
            "tokenizer directory with a tokenizer_config.json"
        )
    vocab = (spec.get("model") or {}).get("vocab") or {}
    added = {t.get("content") for t in spec.get("added_tokens") or []}
    if eod_token not in vocab and eod_token not in added:
        raise DataError(
            f"--eod-token {eod_token!r} is not a token of {path} (neither in its vocabulary "
            "nor an added token); pass one of its special tokens"
        )
    out = Path(f"{output_prefix}_tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").exists() or (out / "tokenizer.json").read_bytes() != (
        p.read_bytes()
    ):
        shutil.copyfile(p, out / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_token}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return str(out.resolve())


def tokenizer_fingerprint(tokenizer_dir: str) -> str:
    """SHA-256 over the tokenizer files that decide the ids."""
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        f = Path(tokenizer_dir, name)
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


# ------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, end)`` of one input: the lines starting there (JSON lines, text lines),
    or the whole file (paragraph or file documents)."""

    index: int
    path: str
    fmt: str  # jsonl | text
    start: int
    end: int
    size: int
    mtime_ns: int

    @property
    def name(self) -> str:
        return f"{self.index:06d}"


def input_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path.lower()
    if name.endswith((".gz", ".bz2", ".xz", ".zst", ".zip")):
        raise DataError(
            f"--input {path}: compressed inputs are not read; decompress it first "
            "(e.g. 'gunzip -k') and pass the JSON lines or text file"
        )
    return "jsonl" if name.endswith(_JSONL_SUFFIXES) else "text"


def plan_chunks(inputs: list[str], fmt: str, text_mode: str, chunk_bytes: int) -> list[Chunk]:
    chunks: list[Chunk] = []
    for path in inputs:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"--input {path}: no such file")
        st = p.stat()
        kind = input_format(path, fmt)
        whole = kind == "text" and text_mode != "line"
        step = st.st_size if whole or st.st_size == 0 else chunk_bytes
        start = 0
        while True:
            end = st.st_size if whole else min(st.st_size, start + step)
            chunks.append(
                Chunk(len(chunks), str(p.resolve()), kind, start, end, st.st_size, st.st_mtime_ns)
            )
            start = end
            if start >= st.st_size:
                break
    return chunks


def _lines(chunk: Chunk):
    """(line number, bytes, end offset) of the lines starting in ``[chunk.start, chunk.end)``."""
    with open(chunk.path, "rb") as f:
        pos = chunk.start
        if pos > 0:
            f.seek(pos - 1)
            if f.read(1) != b"\n":  # inside a line that the chunk before owns: skip it
                pos += len(f.readline())
        f.seek(pos)
        while pos < chunk.end:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            yield line, pos


def documents(chunk: Chunk, keys: tuple[str, ...], text_mode: str):
    """Yield ``(dict key -> text, end offset)`` per document of the chunk."""
    if chunk.fmt == "text" and text_mode != "line":
        text = Path(chunk.path).read_text(encoding="utf-8")
        parts = [text] if text_mode == "file" else _paragraphs(text)
        for i, part in enumerate(parts):
            yield {keys[0]: part}, chunk.end if i == len(parts) - 1 else chunk.start
        return
    for line, pos in _lines(chunk):
        if chunk.fmt == "text":
            yield {keys[0]: line.decode("utf-8").rstrip("\r\n")}, pos
            continue
        if not line.strip():
            yield {}, pos
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{chunk.path}: the line at byte {pos - len(line)} is not JSON ({e}); "
                "fix the line, or read the file as plain text with --input-format text"
            ) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{chunk.path}: the line at byte {pos - len(line)} is a JSON "
                f"{type(row).__name__}, not an object with the key(s) {list(keys)}"
            )
        out = {}
        for k in keys:
            if k not in row:
                raise DataError(
                    f"{chunk.path}: the line at byte {pos - len(line)} has no key {k!r} "
                    f"(it has {sorted(row)[:8]}); fix: --json-keys {' '.join(sorted(row)[:1])}"
                )
            if not isinstance(row[k], str):
                raise DataError(
                    f"{chunk.path}: key {k!r} of the line at byte {pos - len(line)} is a "
                    f"{type(row[k]).__name__}, not a string"
                )
            out[k] = row[k]
        yield out, pos


def _paragraphs(text: str) -> list[str]:
    out, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line)
        elif cur:
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out


# ------------------------------------------------------------------------------- parts
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


def _same(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _part_prefix(parts_dir: Path, chunk: Chunk, key: str) -> Path:
    return parts_dir / f"{chunk.name}_{key}"


def part_done(parts_dir: Path, chunk: Chunk, settings: Settings) -> bool:
    meta = parts_dir / f"{chunk.name}.json"
    if not meta.is_file():
        return False
    try:
        recorded = json.loads(meta.read_text())
    except json.JSONDecodeError:
        return False
    if not _same({k: v for k, v in recorded.items() if k != "stats"}, _sidecar(chunk, settings)):
        return False
    return all(
        Path(f"{_part_prefix(parts_dir, chunk, k)}{ext}").is_file()
        for k in settings.keys
        for ext in (".bin", ".idx")
    )


_WORKER: dict = {}


def _worker_init(tokenizer_dir: str, counter) -> None:
    if _WORKER.get("tokenizer_dir") != tokenizer_dir:  # a forked worker has it already
        _WORKER["tokenizer"] = build_megatron_tokenizer(tokenizer_dir)
        _WORKER["tokenizer_dir"] = tokenizer_dir
    _WORKER["counter"] = counter


def make_part(parts_dir: str, chunk: Chunk, settings: Settings) -> dict:
    """Tokenise one chunk into its part datasets (one per key); returns its statistics."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if _WORKER.get("tokenizer_dir") != settings.tokenizer_dir:
        _worker_init(settings.tokenizer_dir, _WORKER.get("counter"))
    tok = _WORKER["tokenizer"]
    counter = _WORKER.get("counter")
    dtype = getattr(numpy, settings.dtype)
    folder = Path(parts_dir)
    tmp = {k: Path(f"{_part_prefix(folder, chunk, k)}.tmp{os.getpid()}") for k in settings.keys}
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
        final = _part_prefix(folder, chunk, k)
        os.replace(f"{tmp[k]}.bin", f"{final}.bin")
        os.replace(f"{tmp[k]}.idx", f"{final}.idx")
    meta = dict(_sidecar(chunk, settings), stats=stats)
    tmp_meta = folder / f"{chunk.name}.json.tmp{os.getpid()}"
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, folder / f"{chunk.name}.json")  # the part counts only from here on
    return stats


def _make_part_star(args):
    return make_part(*args)


# ------------------------------------------------------------------------------- the run
@dataclass
class Result:
    outputs: dict  # key -> dataset prefix (absolute)
    tokenizer_dir: str
    documents: int
    tokens: dict
    parts_made: int
    parts_kept: int
    skipped: bool  # the outputs were already complete

    def megatron_flags(self) -> list[str]:
        paths = list(self.outputs.values())
        return [
            "--data-path",
            *paths,
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            self.tokenizer_dir,
        ]


def prepare(
    inputs: list[str],
    output_prefix: str,
    tokenizer: str,
    *,
    json_keys: tuple[str, ...] = ("text",),
    input_format_name: str = "auto",
    text_mode: str = "line",
    append_eod: bool = True,
    eod_token: str | None = None,
    workers: int = 1,
    chunk_mib: float = 16.0,
    keep_parts: bool = False,
    progress: bool = True,
) -> Result:
    """Tokenise ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx`` per JSON key."""
    if not inputs:
        raise DataError("no --input given; pass one or more JSON lines or text files")
    if workers < 1:
        raise DataError(f"--workers {workers}: needs at least 1")
    if not chunk_mib > 0:
        raise DataError(f"--chunk-mib {chunk_mib}: must be positive (e.g. 16)")
    if text_mode not in TEXT_MODES:
        raise DataError(f"--text-document {text_mode!r}; known: {TEXT_MODES}")
    keys = tuple(json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise DataError(f"--json-keys {list(keys)}: give one or more distinct keys")
    if any(input_format(p, input_format_name) == "text" for p in inputs) and len(keys) != 1:
        raise DataError(
            f"--json-keys {list(keys)} with a plain-text input: text has one field; give one key "
            "(it names the output, PREFIX_{key}_document)"
        )
    prefix = str(Path(output_prefix).resolve())
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tok_dir = resolve_tokenizer(tokenizer, output_prefix=prefix, eod_token=eod_token)
    _worker_init(tok_dir, None)
    tok = _WORKER["tokenizer"]
    eod = tok.eod if append_eod else None
    if append_eod and eod is None:
        raise DataError(
            f"the tokenizer at {tok_dir} has no EOS token, which Megatron's HuggingFaceTokenizer "
            "uses as EOD; fix: set eos_token in its tokenizer_config.json, or pass --no-append-eod"
        )
    from megatron.core.datasets.indexed_dataset import DType

    settings = Settings(
        keys=keys,
        text_mode=text_mode,
        append_eod=append_eod,
        tokenizer_dir=tok_dir,
        tokenizer_sha256=tokenizer_fingerprint(tok_dir),
        eod=eod,
        vocab_size=int(tok.vocab_size),
        dtype=DType.optimal_dtype(tok.vocab_size).__name__,
    )
    chunks = plan_chunks(list(inputs), input_format_name, text_mode, int(chunk_mib * 2**20))
    outputs = {k: f"{prefix}_{k}_document" for k in keys}
    manifest = {
        "format": FORMAT_VERSION,
        "settings": asdict(settings),
        "chunks": [asdict(c) for c in chunks],
    }
    if _complete(outputs, manifest):
        recorded = json.loads(Path(f"{outputs[keys[0]]}.json").read_text())
        return Result(outputs, tok_dir, recorded["documents"], recorded["tokens"], 0, 0, True)
    parts_dir = Path(f"{prefix}.parts")
    parts_dir.mkdir(exist_ok=True)
    todo = [c for c in chunks if not part_done(parts_dir, c, settings)]
    _run_parts(parts_dir, todo, chunks, settings, workers, progress)
    docs, tokens = 0, {k: 0 for k in keys}
    for c in chunks:
        st = json.loads((parts_dir / f"{c.name}.json").read_text())["stats"]
        docs += st["documents"]
        for k in keys:
            tokens[k] += st["tokens"][k]
    _merge(parts_dir, chunks, outputs, settings, manifest, docs, tokens)
    if not keep_parts:
        shutil.rmtree(parts_dir)
    return Result(outputs, tok_dir, docs, tokens, len(todo), len(chunks) - len(todo), False)


def _complete(outputs: dict, manifest: dict) -> bool:
    for prefix in outputs.values():
        m = Path(f"{prefix}.json")
        if not all(Path(f"{prefix}{ext}").is_file() for ext in (".json", ".bin", ".idx")):
            return False
        try:
            recorded = json.loads(m.read_text())
        except json.JSONDecodeError:
            return False
        if not _same({k: recorded.get(k) for k in manifest}, manifest):
            return False
    return True


def _run_parts(parts_dir, todo, chunks, settings, workers, progress) -> None:
    total = sum(c.end - c.start for c in chunks)
    done_before = total - sum(c.end - c.start for c in todo)
    bar = _Progress(total, done_before, enabled=progress)
    try:
        if workers == 1 or len(todo) <= 1:
            import multiprocessing as mp

            counter = mp.Value("q", 0)
            _worker_init(settings.tokenizer_dir, counter)
            for c in todo:
                make_part(str(parts_dir), c, settings)
                bar.update(counter.value)
            return
        import multiprocessing as mp

        # fork where there is one: the workers inherit the loaded tokenizer and megatron-core
        # (seconds of imports each otherwise); TOKENIZERS_PARALLELISM=false was set before the
        # tokenizer loaded, so no Rust thread pool is forked
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        counter = ctx.Value("q", 0)
        with ctx.Pool(
            min(workers, len(todo)), _worker_init, (settings.tokenizer_dir, counter)
        ) as pool:
            jobs = [(str(parts_dir), c, settings) for c in todo]
            pending = pool.imap_unordered(_make_part_star, jobs)
            for _ in range(len(jobs)):
                while True:
                    try:
                        pending.next(timeout=0.5)
                        break
                    except mp.TimeoutError:
                        bar.update(counter.value)
                bar.update(counter.value)
    finally:
        bar.close()


def _merge(parts_dir, chunks, outputs, settings, manifest, docs, tokens) -> None:
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = getattr(numpy, settings.dtype)
    import gc

    for k, prefix in outputs.items():
        tmp = f"{prefix}.tmp{os.getpid()}"
        builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
        # add_index runs gc.collect() per part: with torch and megatron loaded that walks
        # every object of the process (~1 s a part here); frozen, it walks only the new ones
        gc.freeze()
        try:
            for c in chunks:
                builder.add_index(str(_part_prefix(parts_dir, c, k)))
        finally:
            gc.unfreeze()
        builder.finalize(f"{tmp}.idx")
        os.replace(f"{tmp}.bin", f"{prefix}.bin")
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
        flags = ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", settings.tokenizer_dir]  # fmt: skip
        record = dict(manifest, documents=docs, tokens=tokens, key=k, megatron_flags=flags)
        Path(f"{prefix}.json.tmp").write_text(json.dumps(record, indent=1))
        os.replace(f"{prefix}.json.tmp", f"{prefix}.json")


class _Progress:
    """A tqdm bar over input bytes when tqdm is installed and stderr is a terminal, else a
    line every 10 s (logs of batch jobs)."""

    def __init__(self, total: int, initial: int, *, enabled: bool):
        self.total, self.base, self.enabled = total, initial, enabled
        self.bar = None
        self.t_last = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True,
                            desc="tokenising")  # fmt: skip
        elif initial:
            print(f"[relaymoe data] resuming: {initial / 2**20:.1f} of {total / 2**20:.1f} MiB "
                  "already tokenised", file=sys.stderr)  # fmt: skip

    def update(self, done_now: int) -> None:
        if not self.enabled:
            return
        done = self.base + done_now
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif time.monotonic() - self.t_last >= 10:
            self.t_last = time.monotonic()
            pct = 100 * done / self.total if self.total else 100.0
            print(f"[relaymoe data] {done / 2**20:.1f} / {self.total / 2**20:.1f} MiB "
                  f"({pct:.0f}%)", file=sys.stderr)  # fmt: skip

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------- CLI
def add_parser(sub) -> None:
    """The ``relaymoe data`` subcommand (arguments only; nothing heavy is imported)."""
    d = sub.add_parser(
        "data",
        help="tokenise JSON lines or text into Megatron's indexed dataset (.bin/.idx)",
        description='Tokenises JSON lines ({"text": ...} per line) or plain text with a '
        "Hugging Face tokenizer, as Megatron's HuggingFaceTokenizer does, appends the EOD id and "
        "writes PREFIX_{key}_document.bin/.idx with megatron-core's IndexedDatasetBuilder. "
        "Multi-process; an interrupted run continues where it stopped, a completed output is "
        "kept. Prints the --data-path and --tokenizer-* flags to train with.",
    )
    d.add_argument("--input", nargs="+", required=True, help="JSON lines or text file(s)")
    d.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX_{key}_document.bin/.idx/.json (preprocess_data's names)",
    )
    d.add_argument(
        "--tokenizer",
        required=True,
        help="a local Hugging Face tokenizer directory (e.g. the Qwen3 checkpoint folder), or a "
        "tokenizer.json (with --eod-token)",
    )
    d.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON keys to tokenise (default text)"
    )
    d.add_argument(
        "--input-format",
        choices=INPUT_FORMATS,
        default="auto",
        help="auto (default): .jsonl/.json/.ndjson are JSON lines, anything else text",
    )
    d.add_argument(
        "--text-document",
        choices=TEXT_MODES,
        default="line",
        help="plain text: one document per line (default), per blank-line-separated paragraph, "
        "or per file",
    )
    d.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the tokenizer's EOD id to every document (default on, as preprocess_data's "
        "--append-eod)",
    )
    d.add_argument(
        "--eod-token",
        default=None,
        help="with a bare tokenizer.json: its token that ends a document (e.g. '<|endoftext|>')",
    )
    d.add_argument(
        "--workers",
        type=int,
        default=max(1, min(8, os.cpu_count() or 1)),
        help="tokenising processes (default: the cores, at most 8)",
    )
    d.add_argument(
        "--chunk-mib",
        type=float,
        default=16.0,
        help="input MiB per part, the unit of work and of resumption (default 16)",
    )
    d.add_argument("--keep-parts", action="store_true", help="keep PREFIX.parts/ after the merge")
    d.add_argument("--no-progress", action="store_true", help="no progress bar or lines")


def main(ns) -> int:
    """Run ``relaymoe data`` from its parsed arguments; 0 on success, 2 on a refused input."""
    t0 = time.perf_counter()
    try:
        r = prepare(
            ns.input,
            ns.output_prefix,
            ns.tokenizer,
            json_keys=tuple(ns.json_keys),
            input_format_name=ns.input_format,
            text_mode=ns.text_document,
            append_eod=ns.append_eod,
            eod_token=ns.eod_token,
            workers=ns.workers,
            chunk_mib=ns.chunk_mib,
            keep_parts=ns.keep_parts,
            progress=not ns.no_progress,
        )
    except DataError as e:
        print(f"relaymoe data: error: {e}", file=sys.stderr)
        return 2
    err = sys.stderr
    if r.skipped:
        print("[relaymoe data] the output is complete already (same inputs, tokenizer and "
              "settings): nothing redone", file=err)  # fmt: skip
    else:
        print(f"[relaymoe data] {r.documents} documents, tokens {r.tokens}; parts made "
              f"{r.parts_made}, kept from an earlier run {r.parts_kept}; "
              f"{time.perf_counter() - t0:.1f} s", file=err)  # fmt: skip
    for k, prefix in r.outputs.items():
        print(f"[relaymoe data] {k}: {prefix}.bin / .idx", file=err)
    paths = " ".join(r.outputs.values())
    print(f"[relaymoe data] with examples/qwen3/train.sh: DATA_PATH='{paths}' "
          f"TOKENIZER='{r.tokenizer_dir}'", file=err)  # fmt: skip
    print("[relaymoe data] Megatron flags (stdout, one per line):", file=err)
    print("\n".join(r.megatron_flags()))
    return 0
