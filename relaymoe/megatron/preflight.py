"""The checks ``examples/qwen3/train.sh`` runs before it launches (and in its dry run).

    python -m relaymoe.megatron.preflight [--data-path "W1 P1 ..."] [--tokenizer DIR]
        [--vocab-size V] [--pretrained DIR] [--have-te 0|1] -- MEGATRON ARGS...

Every problem is collected and printed, one per line with its fix, and the exit status is 2
when there is any; nothing is launched by this module. What it checks:

* the command line as Megatron's own parser reads it (relaymoe registered): an unknown or
  malformed flag, among them the user's extra arguments, is refused with argparse's message;
* each dataset prefix of ``--data-path`` has its ``.bin`` and ``.idx``;
* the tokenizer loads as Megatron's ``HuggingFaceTokenizer`` from a local path and its
  vocabulary fits the model's (``--vocab-size``, the config's), so that the embedding keeps the
  config's rows;
* a ``--pretrained`` (``--pretrained-checkpoint``) folder is a Megatron checkpoint;
* what the run needs that is not here: TransformerEngine for context parallelism (CP > 1) or
  for MoE with tensor parallelism (sequence parallelism needs TE's or Apex's norms).
  These are printed as ``needs:`` lines; they fail the check unless ``--dry-run``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _value(argv: list[str], flag: str, default=None):
    for i, a in enumerate(argv[:-1]):
        if a == flag:
            return argv[i + 1]
    return default


def data_path_problems(data_path: str) -> list[str]:
    """The prefixes of a Megatron ``--data-path`` value ("P", "W1 P1 W2 P2") lacking files."""
    words = data_path.split()
    if not words:
        return ["DATA_PATH is set but empty; unset it for mock data or give a dataset prefix"]
    prefixes = words
    try:
        float(words[0])
        if len(words) % 2:
            return [f"DATA_PATH={data_path!r}: weighted paths come in 'WEIGHT PREFIX' pairs"]
        prefixes = words[1::2]
    except ValueError:
        pass
    out = []
    for p in prefixes:
        missing = [ext for ext in (".bin", ".idx") if not Path(p + ext).is_file()]
        if missing:
            out.append(
                f"DATA_PATH: no {' or '.join(p + e for e in missing)} (a prefix names "
                "PREFIX.bin and PREFIX.idx, e.g. /data/qwen_text_document); fix: make it with "
                "'relaymoe data --input corpus.jsonl --output-prefix /data/qwen --tokenizer DIR', "
                "or correct the path (on every node: a shared filesystem)"
            )
    return out


def tokenizer_problems(tokenizer: str, vocab_size: int | None) -> list[str]:
    path = Path(tokenizer)
    if not path.exists():
        return [
            f"TOKENIZER={tokenizer}: no such file or directory; fix: a local Hugging Face "
            "tokenizer folder (e.g. the downloaded Qwen/Qwen3-30B-A3B checkpoint folder, or the "
            "PREFIX_tokenizer/ that relaymoe data made), on every node"
        ]
    from relaymoe.data import DataError, build_megatron_tokenizer

    try:
        tok = build_megatron_tokenizer(str(path))
    except DataError as e:
        return [f"TOKENIZER={tokenizer}: {e}"]
    if vocab_size is not None and tok.vocab_size > vocab_size:
        return [
            f"TOKENIZER={tokenizer} has {tok.vocab_size} tokens, more than the config's "
            f"model.vocab_size={vocab_size}; fix: a config whose vocab_size is at least "
            f"{tok.vocab_size} (a multiple of 128 x TP), or the tokenizer the data was made with"
        ]
    return []


def checkpoint_problems(folder: str, what: str) -> list[str]:
    if not Path(folder, "latest_checkpointed_iteration.txt").is_file():
        return [
            f"{what}={folder} is not a Megatron checkpoint (no latest_checkpointed_iteration.txt); "
            "fix: the --out folder of 'relaymoe convert-hf', or a SAVE_DIR of an earlier run"
        ]
    return []


def parser_problems(argv: list[str]) -> list[str]:
    """argparse's complaint about ``argv`` with Megatron's parser (relaymoe registered)."""
    import contextlib
    import io
    import warnings

    from relaymoe.megatron import register

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        register()
        from megatron.training import arguments

        parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        from relaymoe.megatron.pretrain import extra_args

        extra_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit as e:
        if e.code:
            last = [ln for ln in err.getvalue().splitlines() if ln.strip()][-1:]
            msg = last[0].split("error: ", 1)[-1] if last else "refused"
            return [
                f"Megatron's parser refuses the command line: {msg}; fix the extra argument(s) "
                "(python -m relaymoe.megatron.pretrain --help lists every flag)"
            ]
    return []


def needs(argv: list[str], have_te: bool) -> list[str]:
    """What the run needs that this environment may lack (printed as ``needs:`` lines)."""
    out = []
    cp = int(_value(argv, "--context-parallel-size", 1))
    tp = int(_value(argv, "--tensor-model-parallel-size", 1))
    if not have_te and cp > 1:
        out.append(
            f"this run needs TransformerEngine (CP {cp}): megatron-core's local layers refuse "
            "context parallelism; install it into the environment ('pip install -e \".[te]\"', "
            "or transformer-engine[pytorch] matching your CUDA and torch), or use a config with "
            "parallel.cp: 1"
        )
    if not have_te and tp > 1 and "--num-experts" in argv:
        out.append(
            f"this run needs TransformerEngine or Apex (TP {tp}): MoE needs sequence parallelism "
            "at TP > 1, which megatron-core's torch norms refuse; install TransformerEngine, or "
            "use a config with parallel.tp: 1"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, megatron_argv = argv[:i], argv[i + 1 :]
    else:
        own, megatron_argv = argv, []
    p = argparse.ArgumentParser(prog="python -m relaymoe.megatron.preflight")
    p.add_argument("--data-path", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--pretrained", default=None)
    p.add_argument("--have-te", type=int, choices=(0, 1), default=0)
    p.add_argument("--dry-run", action="store_true")
    ns = p.parse_args(own)
    problems: list[str] = []
    if ns.data_path is not None:
        problems += data_path_problems(ns.data_path)
        if not ns.tokenizer:
            problems.append(
                "DATA_PATH is set but TOKENIZER is not; fix: TOKENIZER=the tokenizer folder the "
                "data was made with (relaymoe data prints it)"
            )
    if ns.tokenizer:
        problems += tokenizer_problems(ns.tokenizer, ns.vocab_size)
    if ns.pretrained:
        problems += checkpoint_problems(ns.pretrained, "PRETRAINED")
    problems += parser_problems(megatron_argv)
    wanted = needs(megatron_argv, bool(ns.have_te))
    for line in wanted:
        print(f"[relaymoe] needs: {line}", file=sys.stderr)
    for line in problems:
        print(f"[relaymoe] error: {line}", file=sys.stderr)
    if problems or (wanted and not ns.dry_run):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
