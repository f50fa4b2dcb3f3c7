"""The tokenizer training builds (megatron-core's ``HuggingFaceTokenizer``) and its fingerprint.

``resolve_tokenizer`` turns a bare ``tokenizer.json`` into the directory Megatron loads;
``tokenizer_fingerprint`` hashes the files that decide the ids (into every part's sidecar).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from relaymoe.data.errors import DataError

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
