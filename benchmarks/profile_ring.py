"""Where a ring pass spends its time: torch.profiler over a few fwd+bwd steps of ``ring_moe``.

For the small-T gap (at 4k-8k tokens per GPU the same-kernel all-to-all is faster than the ring,
whose per-hop cost does not shrink with T). Rank 0 prints the wall time per step, the GPU's busy
time per step (union of kernel intervals, NCCL kernels excluded: they spin while a peer is late)
and the kernels and host ops by total time; ``--out`` writes the table as JSON rows
(``bench: profile_ring``), ``--trace`` a chrome trace.

    torchrun --standalone --nproc-per-node 2 benchmarks/profile_ring.py [--tokens 4096]
        [--mode token|expert] [--steps 5] [--out PATH.jsonl] [--trace PATH.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def busy_us(intervals, exclude=()) -> float:
    """Length of the union of ``(name, start_us, end_us)`` intervals, names containing any of
    ``exclude`` left out (NCCL kernels that spin while a peer is late count as idle)."""
    spans = sorted((a, b) for n, a, b in intervals if not any(x in n for x in exclude))
    total, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (cur_b - cur_a if cur_b is not None else 0.0)


def main(argv=None) -> None:
    import torch
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    from benchmarks._dist import init_dist, make_inputs, qwen3
    from benchmarks.common import JsonlWriter
    from relaymoe.ring import ring_moe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU (default 4k)")
    ap.add_argument("--mode", default="token", choices=["token", "expert"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30, help="rows of the printed table")
    ap.add_argument("--out", default="")
    ap.add_argument("--trace", default="", help="rank 0's chrome trace (.json) to this path")
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
    # Both ranks profile the same steps after a profiled warm-up (the profiler's own start-up
    # would otherwise make one rank wait for the other inside the agreement's all-reduce).
    sched = schedule(wait=0, warmup=2, active=args.steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=sched) as prof:
        for _ in range(2 + args.steps):
            step()
            torch.cuda.synchronize()
            dist.barrier()
            prof.step()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == DeviceType.CUDA]  # fmt: skip
    window = (max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)) if kernels else 0.0
    busy = busy_us(kernels, exclude=("nccl", "Nccl"))
    if rank == 0:
        print(f"[profile_ring] {shape.name} mode={args.mode} EP={world}: {wall_ms:.2f} ms per "
              f"step (host issue incl. syncs {host * 1e3 / args.steps:.2f} ms); GPU busy "
              f"{busy / 1e3 / args.steps:.2f} ms per step outside NCCL kernels, of a "
              f"{window / 1e3 / args.steps:.2f} ms profiled window per step")  # fmt: skip
        if args.trace:
            prof.export_chrome_trace(args.trace)
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
                         "wall_ms_per_step": round(wall_ms, 3),
                         "gpu_busy_ms_per_step": round(busy / 1e3 / args.steps, 3)})  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
