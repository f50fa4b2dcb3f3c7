"""Ring ablation (paper Fig. 17 analog): sequential ring -> + overlap -> + fused grouped kernels.

One ``torchrun`` job (EP = world size), qwen3 shape, expert routing, bf16, fwd+bwd of one layer:

  step 0  ``ring_sequential_unfused``  overlap=False, plain-torch hop kernels
  step 1  ``ring_overlap_unfused``     overlap=True,  plain-torch hop kernels
  step 2  ``ring_overlap_fused``       overlap=True,  fused Triton kernels (the default)

``overlap`` is ``relaymoe.options.RingConfig.overlap``, passed for the step in the call's
``RingConfig`` (``ring_moe(..., config=)``); the unfused steps pass
``backend="torch"`` to ``ring_moe``. Rows: ``bench: ablation`` with ``step`` and ``variant``.
Usage: ``torchrun --nproc-per-node 2 benchmarks/ablation.py [--quick] [--out PATH]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from relaymoe import options  # noqa: E402

# (step, variant, RingConfig.overlap, ring_moe's keywords)
STEPS = [
    (0, "ring_sequential_unfused", False, {"backend": "torch"}),
    (1, "ring_overlap_unfused", True, {"backend": "torch"}),
    (2, "ring_overlap_fused", True, {}),
]


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    from benchmarks import ENV_CONFIG
    from benchmarks._dist import init_dist, make_inputs, qwen3, timed_collective
    from benchmarks.common import JsonlWriter, print_table
    from relaymoe import ring_moe
    from relaymoe.ring import RingRuntime

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8k tokens per GPU (else 32k)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ablation.jsonl"))
    ap.add_argument("--mode", default="expert", choices=options.RING_MODES)
    args = ap.parse_args(argv)

    rank, world, group = init_dist()
    shape = qwen3(8192 if args.quick else 32768)
    x, w13, w2, idx, probs = make_inputs(shape, rank, world)
    dy = torch.randn_like(x)
    writer = JsonlWriter(args.out) if rank == 0 else None
    rows = []
    for step, variant, overlap, kw in STEPS:
        xs = x.detach().requires_grad_()
        w13p, w2p = w13.detach().requires_grad_(), w2.detach().requires_grad_()
        pr = probs.detach().requires_grad_()

        config = ENV_CONFIG.replace(overlap=overlap, mode=args.mode)
        runtime = RingRuntime(group)

        def fwd_bwd(xs=xs, w13p=w13p, w2p=w2p, pr=pr, kw=kw, config=config, runtime=runtime):
            out = ring_moe(xs, w13p, w2p, idx, pr, group=group, config=config, runtime=runtime,
                           **kw)  # fmt: skip
            out.backward(dy)
            xs.grad = w13p.grad = w2p.grad = pr.grad = None

        try:
            fwd_bwd()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            # fixed count on every rank; the slowest rank is the layer's time
            ms = timed_collective(fwd_bwd, 2, 5 if args.quick else 15)
        except Exception as e:
            if rank == 0:
                print(f"[ablation] {variant} failed: {type(e).__name__}: {e}"[:600])
            continue
        if rank == 0:
            rows.append(
                writer.write(
                    {
                        "bench": "ablation",
                        "provider": f"relaymoe_{variant}",
                        "variant": variant,
                        "step": step,
                        "mode": args.mode,
                        "shape": shape.name,
                        "ep": world,
                        "ms_fwd_bwd": round(ms, 3),
                        "tflops_fwd_bwd": round(
                            18 * shape.T * shape.K * shape.H * shape.I / ms / 1e9, 1
                        ),
                        "peak_over_inputs_MiB": round(peak / 2**20, 1),
                    }
                )
            )
    if rank == 0:
        print_table(rows, ["step", "variant", "shape", "ep", "ms_fwd_bwd", "peak_over_inputs_MiB"])
    dist.barrier()
    dist.destroy_process_group()
    return 0 if rows or rank != 0 else 1  # rows are collected on rank 0 only


if __name__ == "__main__":
    sys.exit(main())
