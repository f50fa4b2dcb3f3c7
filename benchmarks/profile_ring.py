"""Where a ring pass spends its time: torch.profiler over a few fwd+bwd steps of ``ring_moe``.

For the small-T gap (at 4k-8k tokens per GPU the same-kernel all-to-all is faster than the ring,
whose per-hop cost does not shrink with T). Rank 0 prints the kernels and host ops by total time
and the wall time per step with the host's share; ``--out`` writes the table as JSON rows
(``bench: profile_ring``).

    torchrun --standalone --nproc-per-node 2 benchmarks/profile_ring.py [--tokens 4096]
        [--mode token|expert] [--steps 5] [--out PATH.jsonl]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from benchmarks._dist import init_dist, make_inputs, qwen3
    from benchmarks.common import JsonlWriter
    from relaymoe.ring import ring_moe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU (default 4k)")
    ap.add_argument("--mode", default="token", choices=["token", "expert"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30, help="rows of the printed table")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    rank, world, group = init_dist()
    shape = qwen3(args.tokens)
    x, w13, w2, idx, probs = make_inputs(shape, rank, world)
    x.requires_grad_()
    w13.requires_grad_()
    w2.requires_grad_()
    probs.requires_grad_()
    dy = torch.randn_like(x)

    def step():
        out = ring_moe(x, w13, w2, idx, probs, group=group, mode=args.mode)
        out.backward(dy)
        for t in (x, w13, w2, probs):
            t.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    host = 0.0
    for _ in range(args.steps):
        h0 = time.perf_counter()
        step()
        host += time.perf_counter() - h0  # host time to issue a step (the GPU may lag behind)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        print(f"[profile_ring] {shape.name} mode={args.mode} EP={world}: {wall_ms:.2f} ms per "
              f"step, host issues a step in {host * 1e3 / args.steps:.2f} ms")  # fmt: skip
        ka = prof.key_averages()
        print(ka.table(sort_by="device_time_total", row_limit=args.top))
        print(ka.table(sort_by="cpu_time_total", row_limit=args.top))
        if args.out:
            w = JsonlWriter(args.out)
            for e in sorted(ka, key=lambda e: -e.device_time_total)[: args.top]:
                w.write({"bench": "profile_ring", "shape": shape.name, "ep": world,
                         "mode": args.mode, "op": e.key, "count": e.count // args.steps,
                         "device_us_per_step": round(e.device_time_total / args.steps, 1),
                         "cpu_us_per_step": round(e.cpu_time_total / args.steps, 1),
                         "wall_ms_per_step": round(wall_ms, 3)})  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
