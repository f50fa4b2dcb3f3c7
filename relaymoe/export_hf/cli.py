"""The ``relaymoe export-hf`` subcommand: its arguments and its run (``add_parser``, ``main``)."""

from __future__ import annotations

import sys

from relaymoe.export_hf.errors import ExportError
from relaymoe.export_hf.run import DTYPES, export


def add_parser(sub) -> None:
    c = sub.add_parser(
        "export-hf",
        help="a Megatron torch_dist checkpoint (any TP/PP/EP, ring or alltoall, TE or local "
        "layers) to a Hugging Face Qwen3-MoE folder (safetensors shards, index, config.json)",
        description="Reads the checkpoint's global tensors one decoder layer at a time (every "
        "expert of every EP rank's file; refused by name when one is missing), renames them "
        "the way convert-hf maps them and writes a Hugging Face Qwen3-MoE folder that "
        "transformers' from_pretrained loads. No model is built, no GPU or process group is "
        "needed. Then compare both with relaymoe check-hf.",
    )
    c.add_argument(
        "--load",
        required=True,
        help="the checkpoint: a Megatron --save folder (its newest iteration, as the tracker "
        "file names it) or one iter_NNNNNNN / release folder in it",
    )
    c.add_argument("--out", required=True, help="a new folder for the Hugging Face checkpoint")
    c.add_argument(
        "--iteration", type=int, default=None, help="export iter_NNNNNNN instead of the newest"
    )
    c.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="dtype of the written tensors (default auto: the checkpoint's, bf16 for a --bf16 run)",
    )
    c.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file, e.g. 5GB (default), 500MB, 2GiB",
    )
    c.add_argument(
        "--base",
        default=None,
        help="the Hugging Face folder the run started from (optional): its tokenizer files and "
        "generation_config.json are copied and config.json's other keys (token ids) kept; it "
        "must be the checkpoint's architecture",
    )


def main(ns) -> int:
    try:
        s = export(
            ns.load,
            ns.out,
            iteration=ns.iteration,
            dtype=ns.dtype,
            max_shard_size=ns.max_shard_size,
            base=ns.base,
        )
    except (ExportError, OSError) as e:
        print(f"relaymoe export-hf: error: {e}", file=sys.stderr)
        return 2
    print(
        f"[relaymoe export-hf] wrote {s['folder']}: {s['tensors']} tensors, {s['shards']} "
        f"shard(s), {s['bytes'] / 1e9:.3g} GB of {s['dtype']}, from {s['iteration_folder']}",
        file=sys.stderr,
    )
    print(
        f"[relaymoe export-hf] compare both: relaymoe check-hf --load {ns.load} --hf {s['folder']}",
        file=sys.stderr,
    )
    return 0
