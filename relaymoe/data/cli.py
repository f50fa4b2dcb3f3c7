"""The ``relaymoe data`` subcommand: its arguments and its run (``add_parser``, ``main``)."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from relaymoe.data.build import prepare
from relaymoe.data.errors import DataError
from relaymoe.data.inputs import INPUT_FORMATS, TEXT_MODES


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
    """Run ``relaymoe data`` from its parsed arguments: 0 on success; 2 on a refused input,
    one line; 130 on Ctrl-C or SIGTERM, one line saying that a rerun continues (the parts
    made so far are kept, the temporary files removed)."""
    from relaymoe.host_warnings import quiet_host_warnings

    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _stop)
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
            worker_setup=quiet_host_warnings,
        )
    except DataError as e:
        print(f"relaymoe data: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        parts = f"{ns.output_prefix}.parts"
        kept = (f"the parts made so far are kept in {parts}/: rerun the same command to "
                "continue from them") if Path(parts).is_dir() else (
                "no part was complete yet: rerun the same command to start again")  # fmt: skip
        print(f"relaymoe data: interrupted; {kept}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    _report(r, time.perf_counter() - t0)
    return 0


def _stop(signum, frame) -> None:
    """SIGTERM (a job's end, ``kill``) stops a run as Ctrl-C does: temporaries removed, the
    completed parts kept for a rerun."""
    raise KeyboardInterrupt


def _report(r, seconds: float) -> None:
    """What was made (stderr), and the flags to train with (stdout, one flag per line)."""
    err = sys.stderr
    if r.skipped:
        print("[relaymoe data] the output is complete already (same inputs, tokenizer and "
              "settings): nothing redone", file=err)  # fmt: skip
    else:
        print(f"[relaymoe data] {r.documents} documents, tokens {r.tokens}; parts made "
              f"{r.parts_made}, kept from an earlier run {r.parts_kept}; "
              f"{seconds:.1f} s", file=err)  # fmt: skip
    for k, prefix in r.outputs.items():
        print(f"[relaymoe data] {k}: {prefix}.bin / .idx", file=err)
    paths = " ".join(r.outputs.values())
    print(f"[relaymoe data] with examples/qwen3/train.sh: DATA_PATH='{paths}' "
          f"TOKENIZER='{r.tokenizer_dir}'", file=err)  # fmt: skip
    print("[relaymoe data] Megatron flags (stdout, one flag per line):", file=err)
    for words in r.megatron_flag_groups():
        print(shlex.join(words))
