"""The ``relaymoe convert-hf`` subcommand: its arguments and its run (``add_parser``, ``main``)."""

from __future__ import annotations

import os
import sys

from relaymoe.convert_hf.errors import ConvertError
from relaymoe.convert_hf.run import DTYPES, FLAGS_FILE, TRANSFORMER_IMPLS, convert


def add_parser(sub) -> None:
    c = sub.add_parser(
        "convert-hf",
        help="a Hugging Face Qwen3-MoE checkpoint (config.json + safetensors) to a Megatron "
        "torch_dist checkpoint (--load / --pretrained-checkpoint, any TP/PP/EP)",
        description="Builds the Megatron GPT model as relaymoe.megatron.pretrain does (on the "
        "host, gloo), copies the Hugging Face weights into it and saves a torch_dist release "
        "checkpoint, weights only. Megatron reshards it on load to any TP/PP/EP and either "
        "dispatcher. Prints the model flags to train with.",
    )
    c.add_argument("--hf", required=True, help="the Hugging Face checkpoint folder")
    c.add_argument("--out", required=True, help="a new folder for the Megatron checkpoint")
    c.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bf16",
        help="dtype of the saved weights (default bf16: what --bf16 training holds)",
    )
    c.add_argument(
        "--config",
        default=None,
        help="a relaymoe config to check the checkpoint's architecture against (e.g. "
        "qwen3_30b_a3b)",
    )
    c.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default=TRANSFORMER_IMPLS[0],
        help="the layer implementation the training run uses (default transformer_engine, "
        "Megatron's default): the checkpoint is written in its spec's keys, which differ in "
        "the norm before each MoE layer; a run with the other one refuses it by name",
    )
    c.add_argument("--pp", type=int, default=1, help="pipeline stages (one process each)")
    c.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel processes (each holds 1/EP of the experts): run under torchrun "
        "--nproc-per-node PP*EP to spread the host memory",
    )


def main(ns) -> int:
    try:
        flags = convert(ns.hf, ns.out, dtype=ns.dtype, pp=ns.pp, ep=ns.ep, config=ns.config,
                        transformer_impl=ns.transformer_impl)  # fmt: skip
    except ConvertError as e:
        print(f"relaymoe convert-hf: error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    if dist.get_rank() == 0:
        out = os.path.abspath(ns.out)
        print(f"[relaymoe convert-hf] wrote {out} (torch_dist, release, weights only, keys of "
              f"--transformer-impl {ns.transformer_impl})",
              file=sys.stderr)  # fmt: skip
        print(f"[relaymoe convert-hf] train from it with --pretrained-checkpoint {out} (or "
              f"--load {out}) --ckpt-format torch_dist and its model flags, one per line in "
              f"{out}/{FLAGS_FILE}: {' '.join(flags)}", file=sys.stderr)  # fmt: skip
    dist.destroy_process_group()
    return 0
