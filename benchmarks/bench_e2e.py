"""End-to-end: the tiny Qwen3-style GPT (4 MoE layers) trained with ring and with alltoall.

    python benchmarks/bench_e2e.py [--steps 200] [--gpus 2] [--config tiny_qwen3]

Two ``torchrun -m relaymoe.megatron.pretrain`` jobs on mock data from the same seed (see
``relaymoe/megatron/e2e.py``), one per dispatcher, in this one invocation. Prints the loss
curves' max |difference|, tokens/s (median over steps after 5 warm-up steps, global tokens per
step / step time) and peak memory (``max_memory_allocated`` per step on the reporting rank: the
largest after 5 warm-up steps, and the warm-up steps' own), and appends
rows ``bench: e2e`` (providers ``relaymoe_ring``, ``mcore_alltoall``) to
``benchmarks/results/e2e.jsonl``. Must finish in < 3 minutes on 2 GPUs.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import ROOT, JsonlWriter
from relaymoe.megatron.e2e import compare, print_summary, run_dispatcher

PROVIDER = {"ring": "relaymoe_ring", "alltoall": "mcore_alltoall"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny_qwen3")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="accepted for the suite; same 200 steps")
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e.jsonl"))
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_e2e: needs CUDA GPUs (1 or 2); nothing measured")
        return 3
    gpus = a.gpus or min(2, torch.cuda.device_count())
    runs = [
        run_dispatcher(a.config, d, gpus=gpus, steps=a.steps, seed=a.seed)
        for d in ("ring", "alltoall")
    ]
    for r in runs:
        if r.returncode != 0 or not r.steps:
            print(
                f"--- {r.dispatcher} failed rc={r.returncode}\n{r.command}\n{r.log_tail}",
                file=sys.stderr,
            )
    cmp = compare(*runs)
    print_summary(runs, cmp)
    w = JsonlWriter(a.out)
    for r in runs:
        w.write(
            {
                "bench": "e2e",
                "provider": PROVIDER[r.dispatcher],
                "shape": f"{a.config}_steps{a.steps}",
                "ep": gpus,
                "steps": len(r.steps),
                "tokens_per_s": r.tokens_per_s(),
                "peak_MiB": r.peak_mib(),
                "warmup_peak_MiB": r.warmup_peak_mib(),
                "first_loss": r.losses[0] if r.steps else None,
                "final_loss": r.losses[-1] if r.steps else None,
                "losses": r.losses,
                "max_abs_loss_diff_vs_other": cmp["max_abs_loss_diff"],
                "mean_abs_loss_diff_vs_other": cmp["mean_abs_loss_diff"],
                "wall_s": r.seconds,
                "returncode": r.returncode,
            }
        )
    print(f"rows appended to {a.out}")
    return 0 if all(r.returncode == 0 and r.steps for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
