"""What a training run needs of one dataset prefix (a ``--data-path`` entry), checked before it
starts: ``dataset_problems``.

Megatron reads ``PREFIX.bin`` and ``PREFIX.idx``, memory-maps the ``.bin`` (an empty one cannot
be mapped: the run stops there) and takes the token ids as they are: ids made by another
tokenizer than the one training builds from ``--tokenizer-model`` are read without complaint,
and train a model whose inputs, labels and EOD mean something else, or index past its
embedding. A dataset made by ``relaymoe data`` records its tokenizer in its manifest
(``PREFIX.json``: the SHA-256 of the tokenizer files that decide the ids, and the vocabulary
size), so the two can be compared before anything is launched. A dataset made by another tool
(Megatron-LM's ``preprocess_data.py``) has no manifest; only its files are checked.
"""

from __future__ import annotations

import json
from pathlib import Path

from relaymoe.data.tokenizer import tokenizer_fingerprint

_REMAKE = (
    "'relaymoe data --input corpus.jsonl --output-prefix /data/qwen --tokenizer DIR' makes one"
)


def dataset_problems(prefix: str, tokenizer_dir: str | None) -> list[str]:
    """Why training cannot read the dataset ``prefix`` with the tokenizer ``tokenizer_dir``
    (None: not checked against one), one line each with its fix; empty when it can."""
    missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
    if missing:
        return [
            f"DATA_PATH: no {' or '.join(prefix + e for e in missing)} (a prefix names "
            f"PREFIX.bin and PREFIX.idx, e.g. /data/qwen_text_document); fix: {_REMAKE}, or "
            "correct the path (on every node: a shared filesystem)"
        ]
    if Path(prefix + ".bin").stat().st_size == 0:
        return [
            f"DATA_PATH: {prefix}.bin is empty (no token), which Megatron cannot read; fix: "
            f"make the dataset again from a corpus with text ({_REMAKE})"
        ]
    recorded = _manifest_tokenizer(prefix)
    if recorded is None or tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
        return []
    sha, vocab, made_with = recorded
    if tokenizer_fingerprint(tokenizer_dir) == sha:
        return []
    return [
        f"TOKENIZER={tokenizer_dir} is not the tokenizer DATA_PATH {prefix} was made with "
        f"({made_with}, {vocab} tokens, per {prefix}.json): training would read its ids with "
        f"another vocabulary; fix: TOKENIZER={made_with} (the one relaymoe data printed), or "
        "make the dataset again with this tokenizer"
    ]


def _manifest_tokenizer(prefix: str) -> tuple[str, int, str] | None:
    """``(sha256, vocab size, folder)`` of the tokenizer ``relaymoe data``'s manifest of
    ``prefix`` records; None without such a manifest."""
    try:
        manifest = json.loads(Path(prefix + ".json").read_text())
        settings = manifest["settings"]
        return (
            str(settings["tokenizer_sha256"]),
            int(settings["vocab_size"]),
            str(settings["tokenizer_dir"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
