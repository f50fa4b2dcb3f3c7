"""``prepare``: the inputs tokenised into their parts, then merged in input order into the output.

A completed output has a manifest (``PREFIX_{key}_document.json``, which also records the
Megatron flags to train with); when it matches, nothing is redone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from relaymoe.data.errors import DataError
from relaymoe.data.inputs import TEXT_MODES, input_format, plan_chunks
from relaymoe.data.lock import PrefixLock
from relaymoe.data.parts import (
    FORMAT_VERSION,
    Settings,
    make_part,
    make_part_star,
    part_done,
    part_prefix,
    same_json,
    worker_init,
    worker_tokenizer,
)
from relaymoe.data.progress import Progress
from relaymoe.data.tokenizer import resolve_tokenizer, tokenizer_fingerprint

# the names parts.make_part writes before renaming: CHUNK_KEY.tmpPID.bin/.idx, CHUNK.json.tmpPID
_TEMPORARY = re.compile(r"\.tmp\d+(\.bin|\.idx)?$")


@dataclass
class Result:
    outputs: dict  # key -> dataset prefix (absolute)
    tokenizer_dir: str
    documents: int
    tokens: dict
    parts_made: int
    parts_kept: int
    skipped: bool  # the outputs were already complete

    def megatron_flag_groups(self) -> list[list[str]]:
        """The flags to train with, one list per flag: the flag, then its values."""
        return [
            ["--data-path", *self.outputs.values()],
            ["--tokenizer-type", "HuggingFaceTokenizer"],
            ["--tokenizer-model", self.tokenizer_dir],
        ]

    def megatron_flags(self) -> list[str]:
        return [word for group in self.megatron_flag_groups() for word in group]


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
    worker_setup=None,
) -> Result:
    """Tokenise ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx`` per JSON key.

    One run per prefix (``PrefixLock``; a second is refused). A run that fails or is
    interrupted removes its temporary files and keeps its completed parts, which a rerun
    reuses. ``worker_setup``: a picklable function each worker process runs first (the command
    line passes ``relaymoe.host_warnings.quiet_host_warnings``)."""
    keys = _checked_settings(inputs, json_keys, input_format_name, text_mode, workers, chunk_mib)
    prefix = str(Path(output_prefix).resolve())
    chunks = plan_chunks(list(inputs), input_format_name, text_mode, int(chunk_mib * 2**20))
    if not any(c.size for c in chunks):
        raise DataError(
            f"--input {' '.join(inputs)}: empty (0 bytes), nothing to tokenise; Megatron "
            "cannot train on an empty dataset; fix: pass the corpus files"
        )
    folder = Path(prefix).parent
    made = _made_folder(folder, output_prefix)
    try:
        with PrefixLock(prefix):
            _remove_temporaries(prefix, keys)  # of a run that was killed before it could
            try:
                settings = _settings(tokenizer, prefix, keys, text_mode, append_eod, eod_token)
                return _make(prefix, inputs, chunks, settings, workers, keep_parts, progress,
                             worker_setup)  # fmt: skip
            except BaseException:
                _remove_temporaries(prefix, keys)
                raise
    except BaseException:
        if made is not None:  # a failed run leaves no folder it made (when nothing is in it)
            for path in [folder, *folder.parents][: len(folder.parents) - len(made.parents) + 1]:
                with contextlib.suppress(OSError):
                    path.rmdir()
        raise


def _made_folder(folder: Path, output_prefix: str) -> Path | None:
    """Create the output ``folder``; the topmost folder this created (None: it existed)."""
    missing = next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"--output-prefix {output_prefix}: cannot create the folder {folder} "
            f"({e.strerror}); fix: a prefix in a folder you can write"
        ) from None
    return missing


def _checked_settings(inputs, json_keys, input_format_name, text_mode, workers, chunk_mib):
    """The JSON keys, once the settings that need no file are checked."""
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
    return keys


def _settings(tokenizer, prefix, keys, text_mode, append_eod, eod_token) -> Settings:
    """What every part is made with: the tokenizer folder (a bare ``tokenizer.json`` made into
    one beside the output), its fingerprint, EOD and vocabulary, and the settings."""
    tok_dir = resolve_tokenizer(tokenizer, output_prefix=prefix, eod_token=eod_token)
    tok = worker_tokenizer(tok_dir)
    eod = tok.eod if append_eod else None
    if append_eod and eod is None:
        raise DataError(
            f"the tokenizer at {tok_dir} has no EOS token, which Megatron's HuggingFaceTokenizer "
            "uses as EOD; fix: set eos_token in its tokenizer_config.json, or pass --no-append-eod"
        )
    from megatron.core.datasets.indexed_dataset import DType

    return Settings(
        keys=keys,
        text_mode=text_mode,
        append_eod=append_eod,
        tokenizer_dir=tok_dir,
        tokenizer_sha256=tokenizer_fingerprint(tok_dir),
        eod=eod,
        vocab_size=int(tok.vocab_size),
        dtype=DType.optimal_dtype(tok.vocab_size).__name__,
    )


def _make(prefix, inputs, chunks, settings, workers, keep_parts, progress, worker_setup) -> Result:
    """The outputs of ``chunks``: kept when complete, else the missing parts, then the merge."""
    keys, tok_dir = settings.keys, settings.tokenizer_dir
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
    _run_parts(parts_dir, todo, chunks, settings, workers, progress, worker_setup)
    docs, tokens = 0, {k: 0 for k in keys}
    for c in chunks:
        st = json.loads((parts_dir / f"{c.name}.json").read_text())["stats"]
        docs += st["documents"]
        for k in keys:
            tokens[k] += st["tokens"][k]
    _refuse_empty(parts_dir, inputs, docs, tokens)
    _merge(parts_dir, chunks, outputs, settings, manifest, docs, tokens)
    if not keep_parts:
        shutil.rmtree(parts_dir)
    return Result(outputs, tok_dir, docs, tokens, len(todo), len(chunks) - len(todo), False)


def _refuse_empty(parts_dir: Path, inputs, docs: int, tokens: dict) -> None:
    """``DataError`` when the inputs hold no document, or a key no token: Megatron cannot
    memory-map an empty ``.bin``. With no document at all, the (empty) parts go too."""
    if docs == 0:
        shutil.rmtree(parts_dir, ignore_errors=True)
        raise DataError(
            f"--input {' '.join(inputs)}: no document (every line or field is empty), so the "
            "dataset would be empty, which Megatron cannot train on; fix: pass the corpus files "
            "(for JSON lines, check --json-keys)"
        )
    empty = [k for k, n in tokens.items() if n == 0]
    if empty:
        raise DataError(
            f"--json-keys {' '.join(empty)}: no token in any document (every such field is "
            "empty, and --no-append-eod adds none), so that dataset would be empty; fix: drop "
            "those keys, or append the EOD"
        )


def _remove_temporaries(prefix: str, keys: tuple[str, ...]) -> None:
    """Remove the temporary files a run writes before renaming them into place (in
    ``PREFIX.parts/`` and beside the outputs), and the parts folder when nothing is left in
    it; the completed parts stay. Called under the prefix's lock, so no other run owns them."""
    parts_dir = Path(f"{prefix}.parts")
    if parts_dir.is_dir():
        for f in parts_dir.iterdir():
            if _TEMPORARY.search(f.name):
                f.unlink(missing_ok=True)
        if not any(parts_dir.iterdir()):
            parts_dir.rmdir()
    folder, base = Path(prefix).parent, Path(prefix).name
    starts = tuple(f"{base}_{k}_document.{tail}" for k in keys for tail in ("tmp", "json.tmp"))
    for f in folder.iterdir():
        if f.name.startswith(starts):
            f.unlink(missing_ok=True)


def _complete(outputs: dict, manifest: dict) -> bool:
    for prefix in outputs.values():
        m = Path(f"{prefix}.json")
        if not all(Path(f"{prefix}{ext}").is_file() for ext in (".json", ".bin", ".idx")):
            return False
        try:
            recorded = json.loads(m.read_text())
        except json.JSONDecodeError:
            return False
        if not same_json({k: recorded.get(k) for k in manifest}, manifest):
            return False
    return True


def _run_parts(parts_dir, todo, chunks, settings, workers, progress, worker_setup) -> None:
    total = sum(c.end - c.start for c in chunks)
    done_before = total - sum(c.end - c.start for c in todo)
    bar = Progress(total, done_before, enabled=progress)
    try:
        if workers == 1 or len(todo) <= 1:
            import multiprocessing as mp

            counter = mp.Value("q", 0)
            worker_init(settings.tokenizer_dir, counter)  # this process: no setup to run
            for c in todo:
                make_part(str(parts_dir), c, settings)
                bar.update(counter.value)
            return
        import multiprocessing as mp

        # spawned, not forked: loading the tokenizer here may have started the tokenizers
        # library's Rust thread pool, which a fork would copy without its threads (a deadlock, or
        # the library's fork warning); each spawned worker imports megatron-core and loads the
        # tokenizer once, and this process's environment is left as the caller set it
        ctx = mp.get_context("spawn")
        counter = ctx.Value("q", 0)
        # the workers start with Ctrl-C ignored (an ignored signal stays so across exec, and
        # Python then installs no KeyboardInterrupt handler): the terminal's SIGINT reaches the
        # whole process group, and only this process reports it (prepare's caller); leaving the
        # pool terminates them
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            pool = ctx.Pool(min(workers, len(todo)), worker_init,
                            (settings.tokenizer_dir, counter, worker_setup))  # fmt: skip
        finally:
            signal.signal(signal.SIGINT, handler)
        with pool:
            jobs = [(str(parts_dir), c, settings) for c in todo]
            pending = pool.imap_unordered(make_part_star, jobs)
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
        # every object of the process, the merge's main cost; frozen, it walks only the new ones
        gc.freeze()
        try:
            for c in chunks:
                builder.add_index(str(part_prefix(parts_dir, c, k)))
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
