"""A small real-text corpus and a tokenizer for the tiny Qwen3 example, made offline.

    python examples/tiny_qwen3/make_corpus.py OUT_DIR [--max-mib 4] [--vocab 1024]

The text is the Python standard library's own top-level modules (``*.py`` of the running
interpreter's stdlib, about 4.6 MB on CPython 3.12), which every machine with Python has, so
the repository ships no corpus and nothing is downloaded. Each module is cut into documents of
about 40 lines at blank lines (code, comments and docstrings: real, learnable token statistics).
Writes ``OUT_DIR/corpus.jsonl`` (``{"text": ...}`` per line) and a byte-level BPE tokenizer of
``--vocab`` tokens trained on it with the ``tokenizers`` library (``OUT_DIR/tokenizer/``:
``tokenizer.json`` and a ``tokenizer_config.json`` whose EOS token ``<|endoftext|>`` is the
EOD Megatron appends), the size of ``configs/tiny_qwen3.yaml``'s vocabulary. Deterministic for
a given Python: files in sorted order, nothing random. Then:

    relaymoe data --input OUT_DIR/corpus.jsonl --output-prefix OUT_DIR/stdlib \
        --tokenizer OUT_DIR/tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

EOD = "<|endoftext|>"


def documents(max_bytes: int, lines_per_doc: int = 40):
    """Documents of about ``lines_per_doc`` lines from the stdlib's modules, up to
    ``max_bytes`` of text in all."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        cur: list[str] = []
        for line in lines:
            cur.append(line)
            if len(cur) >= lines_per_doc and not line.strip():
                text = "\n".join(cur).strip("\n")
                cur = []
                if text:
                    yield text
                    total += len(text.encode())
                    if total >= max_bytes:
                        return
        text = "\n".join(cur).strip("\n")
        if text:
            yield text
            total += len(text.encode())
            if total >= max_bytes:
                return


def train_tokenizer(texts: list[str], vocab: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="folder for corpus.jsonl and tokenizer/")
    p.add_argument("--max-mib", type=float, default=4.0, help="text to take (default 4 MiB)")
    p.add_argument("--vocab", type=int, default=1024, help="tokenizer size (default 1024)")
    a = p.parse_args(argv)
    if a.vocab < 300:  # 256 byte symbols + the EOD token + some merges
        p.error(f"--vocab {a.vocab}: a byte-level BPE needs more than 257 tokens; use >= 300")
    if not a.max_mib > 0:
        p.error(f"--max-mib {a.max_mib}: must be positive")
    texts = list(documents(int(a.max_mib * 2**20)))
    if not texts:
        print(f"no stdlib modules found under {sysconfig.get_paths()['stdlib']}", file=sys.stderr)
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    train_tokenizer(texts, a.vocab, out / "tokenizer")
    size = (out / "corpus.jsonl").stat().st_size
    print(f"[tiny_qwen3] {len(texts)} documents ({size / 2**20:.1f} MiB) in {out}/corpus.jsonl; "
          f"tokenizer ({a.vocab} tokens) in {out}/tokenizer", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
