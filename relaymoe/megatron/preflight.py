"""The checks ``examples/qwen3/train.sh`` runs before it launches (and in its dry run): what the
real run will read, checked with nothing launched.

    python -m relaymoe.megatron.preflight [--data-path "W1 P1 ..."] [--tokenizer DIR]
        [--vocab-size V] [--pretrained DIR] [--save-dir DIR] [--have-te 0|1] [--dry-run]
        [--nnodes N --gpus-per-node G --master-addr A --master-port P] [--visible-gpus K]
        -- MEGATRON ARGS...

Every problem is printed as one line with its fix, and the exit status is 2 when there is
any; nothing is launched by this module. What it checks:

* the command line as Megatron's own parser reads it (relaymoe registered): an unknown or
  malformed flag, among them the user's extra arguments, is refused with argparse's message;
* the options, with the checks the launch applies to Megatron's parsed arguments
  (``validate.launch_refusal``: the ring's and the fused loss's), the cluster's GPUs per node
  standing in for ``--relaymoe-gpus-per-node`` when the flags do not give it;
* the cluster (``cluster_checks``): ``MASTER_ADDR`` set, resolvable and not a loopback address
  when ``NNODES > 1``; on a real launch, at least ``GPUS_PER_NODE`` GPUs visible here
  (``--visible-gpus``, counted by train.sh); a config's ``parallel.gpus_per_node`` equal to it;
* each dataset prefix of ``--data-path`` (``relaymoe.data.dataset_problems``): its ``.bin`` and
  ``.idx``, not empty, and made with ``TOKENIZER`` when its manifest says which tokenizer;
* the tokenizer loads as Megatron's ``HuggingFaceTokenizer`` from a local path and its
  vocabulary fits the model's (``--vocab-size``, the config's), so that the embedding keeps the
  config's rows;
* the checkpoint the run will read (``--load`` when it holds one, else
  ``--pretrained-checkpoint``), and ``--pretrained`` (PRETRAINED) in any case: a Megatron
  checkpoint whose saved arguments (``checkpoint_info``) describe the model this run builds, in
  the same ``--transformer-impl`` keys, and whose optimizer state (on a resume) loads at this
  run's TP/PP/EP (``checkpoint_compat``);
* what the run needs that is not here: TransformerEngine for context parallelism (CP > 1) or
  for MoE with tensor parallelism (sequence parallelism needs TE's or Apex's norms).
  These are printed as ``needs:`` lines; they fail the check unless ``--dry-run``.

A dry run also prints what the run would announce at start about its precision
(``validate.fp8_expert_notice``: under an fp8 recipe, which expert GEMMs run in fp8, or why
``--relaymoe-fp8-experts auto`` keeps them in bf16); a real run prints it itself.
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


def data_path_problems(data_path: str, tokenizer: str | None = None) -> list[str]:
    """Why the run cannot read the datasets of a Megatron ``--data-path`` value ("P",
    "W1 P1 W2 P2") with the tokenizer ``tokenizer`` (``relaymoe.data.dataset_problems``)."""
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
    from relaymoe.data import dataset_problems

    return [line for p in prefixes for line in dataset_problems(p, tokenizer)]


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


def checkpoint_problems(args, *, pretrained: str | None, save_dir: str | None) -> list[str]:
    """Why the run of Megatron arguments ``args`` cannot load the checkpoint it will read
    (``--load`` when that folder holds one, else ``--pretrained-checkpoint``, as Megatron
    decides), and whether PRETRAINED (``pretrained``) is a checkpoint at all. Named by the
    train.sh variable that gave the folder (SAVE_DIR, PRETRAINED)."""
    from relaymoe.megatron.checkpoint_info import has_checkpoint, read_checkpoint

    load = getattr(args, "load", None)
    start = getattr(args, "pretrained_checkpoint", None)
    if has_checkpoint(load):
        folder, finetune = load, bool(getattr(args, "finetune", False))
    elif start:
        folder, finetune = start, True
    else:
        folder, finetune = None, False
    out = []
    if pretrained and not _same_folder(pretrained, folder):
        info = read_checkpoint(pretrained)
        if isinstance(info, str):
            out.append(f"PRETRAINED={pretrained}: {info}")
    if folder is not None:
        what = next((f"{k}={v}" for k, v in (("SAVE_DIR", save_dir), ("PRETRAINED", pretrained))
                     if _same_folder(v, folder)), f"--load {folder}")  # fmt: skip
        info = read_checkpoint(folder)
        if isinstance(info, str):
            return [*out, f"{what}: {info}"]
        out += _loaded_checkpoint_problems(info, args, what, finetune)
    return out


def _same_folder(a: str | None, b: str | None) -> bool:
    return bool(a and b) and Path(a).resolve() == Path(b).resolve()


def _loaded_checkpoint_problems(info, args, what: str, finetune: bool) -> list[str]:
    """The refusals of ``checkpoint_compat`` for checkpoint ``info`` and run ``args``."""
    from relaymoe.megatron import checkpoint_compat as cc

    saved = info.args
    if saved is None:
        return []  # not torch_dist, or without saved arguments: Megatron's own load decides
    out = []
    why = cc.impl_mismatch(saved, args)
    if why:
        out.append(f"{what}: {why}")
    diff = cc.architecture_mismatch(saved, args)
    if diff:
        shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
        flags = Path(info.folder, "megatron_model_flags.txt")
        hint = f" (its model flags: {flags})" if flags.is_file() else ""
        out.append(
            f"{what} holds another model than this run builds ({shown}); fix: the config the "
            f"checkpoint was made for{hint}, or a checkpoint of this config ('relaymoe "
            "convert-hf --config NAME' checks a conversion against it)"
        )
    why = cc.resume_layout_problem(saved, info.content, args, release=info.release,
                                   finetune=finetune)  # fmt: skip
    if why:
        out.append(f"{what}: {why}")
    return out


def parsed_args(argv: list[str]) -> tuple[argparse.Namespace | None, str | None]:
    """``argv`` parsed by Megatron's parser (relaymoe registered): ``(args, None)``, or
    ``(None, argparse's complaint as one line with the fix)``."""
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
            return parser.parse_args(argv), None
    except SystemExit:
        last = [ln for ln in err.getvalue().splitlines() if ln.strip()][-1:]
        msg = last[0].split("error: ", 1)[-1] if last else "refused"
        return None, (
            f"Megatron's parser refuses the command line: {msg}; fix the extra argument(s) "
            "(python -m relaymoe.megatron.pretrain --help lists every flag)"
        )


def parser_problems(argv: list[str]) -> list[str]:
    """argparse's complaint about ``argv`` with Megatron's parser (relaymoe registered)."""
    why = parsed_args(argv)[1]
    return [why] if why else []


def options_problems(args, gpus_per_node: int | None) -> list[str]:
    """What the launch refuses in ``args`` (``validate.launch_refusal``), with the cluster's
    ``gpus_per_node`` where the flags give no ``--relaymoe-gpus-per-node`` (the ring then reads
    the same boundaries from the hosts)."""
    from relaymoe.megatron.validate import launch_refusal

    checked = argparse.Namespace(**vars(args))
    if getattr(checked, "relaymoe_gpus_per_node", None) is None and gpus_per_node:
        checked.relaymoe_gpus_per_node = gpus_per_node
    why = launch_refusal(checked)
    return [why] if why else []


def needs(argv: list[str], have_te: bool) -> list[str]:
    """What the run needs that this environment may lack (printed as ``needs:`` lines)."""
    out = []
    cp = int(_value(argv, "--context-parallel-size", 1))
    tp = int(_value(argv, "--tensor-model-parallel-size", 1))
    if not have_te and cp > 1:
        out.append(
            f"this run needs TransformerEngine (CP {cp}): megatron-core's local layers refuse "
            "context parallelism; fix: install it into the environment ('pip install -e "
            '".[te]"\', or transformer-engine[pytorch] matching your CUDA and torch), or use a '
            "config with parallel.cp: 1"
        )
    if not have_te and tp > 1 and "--num-experts" in argv:
        out.append(
            f"this run needs TransformerEngine or Apex (TP {tp}): MoE needs sequence parallelism "
            "at TP > 1, which megatron-core's torch norms refuse; fix: install TransformerEngine, "
            "or use a config with parallel.tp: 1"
        )
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m relaymoe.megatron.preflight")
    p.add_argument("--data-path", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--pretrained", default=None)
    p.add_argument("--save-dir", default=None)
    p.add_argument("--have-te", type=int, choices=(0, 1), default=0)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--nnodes", type=int, default=None)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--master-addr", default="")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--visible-gpus", type=int, default=None, help="on a real launch")
    return p


def problems_of(ns, megatron_argv: list[str]) -> list[str]:
    """Every refusal of the checks above for preflight arguments ``ns`` and the launch's
    ``megatron_argv``, one line each."""
    problems: list[str] = []
    if ns.data_path is not None:
        problems += data_path_problems(ns.data_path, ns.tokenizer)
        if not ns.tokenizer:
            problems.append(
                "DATA_PATH is set but TOKENIZER is not; fix: TOKENIZER=the tokenizer folder the "
                "data was made with (relaymoe data prints it)"
            )
    if ns.tokenizer:
        problems += tokenizer_problems(ns.tokenizer, ns.vocab_size)
    args, why = parsed_args(megatron_argv)
    if why:
        problems.append(why)
    if ns.nnodes is not None:
        from relaymoe.megatron.cluster_checks import cluster_problems

        problems += cluster_problems(
            nnodes=ns.nnodes, gpus_per_node=ns.gpus_per_node or 1, master_addr=ns.master_addr,
            master_port=ns.master_port, visible_gpus=None if ns.dry_run else ns.visible_gpus,
            config_gpus_per_node=getattr(args, "relaymoe_gpus_per_node", None),
        )  # fmt: skip
    if args is not None:
        problems += options_problems(args, ns.gpus_per_node)
        problems += checkpoint_problems(args, pretrained=ns.pretrained, save_dir=ns.save_dir)
    elif ns.pretrained:
        from relaymoe.megatron.checkpoint_info import read_checkpoint

        info = read_checkpoint(ns.pretrained)
        problems += [f"PRETRAINED={ns.pretrained}: {info}"] if isinstance(info, str) else []
    return problems


def dry_run_notices(megatron_argv: list[str]) -> list[str]:
    """The lines the run would print at start about its precision (``fp8_expert_notice``), for
    a dry run; none when the command line does not parse (its refusal says why)."""
    from relaymoe.megatron.validate import fp8_expert_notice

    args, _ = parsed_args(megatron_argv)
    notice = None if args is None else fp8_expert_notice(args)
    return [notice] if notice else []


def main(argv: list[str] | None = None) -> int:
    from relaymoe.host_warnings import quiet_host_warnings

    quiet_host_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, megatron_argv = argv[:i], argv[i + 1 :]
    else:
        own, megatron_argv = argv, []
    ns = _parser().parse_args(own)
    problems = problems_of(ns, megatron_argv)
    wanted = needs(megatron_argv, bool(ns.have_te))
    if not ns.dry_run:  # the launch itself: what it needs is a refusal
        problems, wanted = problems + wanted, []
    for line in problems:  # a refused launch: its refusals alone, one line each
        print(f"[relaymoe] error: {line}; nothing was launched", file=sys.stderr)
    if problems:
        return 2
    for line in wanted:
        print(f"[relaymoe] needs: {line}", file=sys.stderr)
    if ns.dry_run:
        for line in dry_run_notices(megatron_argv):
            print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
