"""The ``relaymoe check-hf`` subcommand: its arguments and its run (``add_parser``, ``main``)."""

from __future__ import annotations

import sys

from relaymoe.check_hf.errors import CheckError
from relaymoe.check_hf.run import TOLERANCE, check


def add_parser(sub) -> None:
    c = sub.add_parser(
        "check-hf",
        help="compare a Megatron checkpoint with a Hugging Face folder: the logits of a few "
        "fixed prompts, PASS/FAIL against a bound (after convert-hf or export-hf)",
        description="Runs a few fixed prompts through the Megatron model a training run "
        "builds (loaded by Megatron's load_checkpoint; ring dispatcher; on the host, fp32) and "
        "through transformers' Qwen3MoeForCausalLM loaded from the folder, and prints each "
        "prompt's relative logits error and PASS or FAIL against the bound. Exit status: 0 "
        "PASS, 1 FAIL, 2 a pair it cannot compare.",
    )
    c.add_argument(
        "--load",
        required=True,
        help="the Megatron checkpoint (a --save folder, or one iter_NNNNNNN / release in it)",
    )
    c.add_argument("--hf", required=True, help="the Hugging Face folder")
    c.add_argument(
        "--iteration", type=int, default=None, help="check iter_NNNNNNN instead of the newest"
    )
    c.add_argument(
        "--tol",
        type=float,
        default=TOLERANCE,
        help="the bound on each prompt's |megatron - hf| / |hf| (default %(default)g: fp32 "
        "rounding is about 1e-7, a wrong tensor far above)",
    )
    c.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel processes for the Megatron model (each holds 1/EP of the "
        "experts): run under torchrun --nproc-per-node EP to spread the host memory",
    )


def main(ns) -> int:
    try:
        r = check(ns.load, ns.hf, iteration=ns.iteration, ep=ns.ep, tolerance=ns.tol)
    except CheckError as e:
        print(f"relaymoe check-hf: error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    if r is None:  # not rank 0: rank 0 reports
        dist.destroy_process_group()
        return 0
    print(
        f"relaymoe check-hf: {ns.load} (Megatron, ring, EP {ns.ep}) vs {ns.hf} "
        f"(transformers), fp32 on the host, prompts from the {r.source}"
    )
    for k, p in enumerate(r.prompts):
        print(
            f"  prompt {k} ({p.tokens} tokens): relative logits error {p.rel_err:.3g}, "
            f"same top-1 token at {p.top1_agree}/{p.tokens} positions"
        )
    for problem in r.load_problems:
        print(f"  transformers, loading the folder: {problem}")
    verdict = "PASS" if r.passed else "FAIL"
    sign = "<=" if r.worst <= r.tolerance else ">"
    why = "; the folder's tensors do not match its model" if r.load_problems else ""
    print(f"{verdict}: largest relative error {r.worst:.3g} {sign} bound {r.tolerance:g}{why}")
    dist.destroy_process_group()
    return 0 if r.passed else 1
