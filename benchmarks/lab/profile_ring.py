"""Where a ring pass spends its time: torch.profiler over a few fwd+bwd steps of ``ring_moe``.

For the small-T gap (at 4k-8k tokens per GPU the same-kernel all-to-all is faster than the ring,
whose per-hop cost does not shrink with T). Rank 0 prints the wall time per step, the GPU's busy
time per step (union of kernel intervals, NCCL kernels excluded: they spin while a peer is late)
and the kernels and host ops by total time; ``--out`` writes the table as JSON rows
(``bench: profile_ring``), ``--trace`` a chrome trace.

    torchrun --standalone --nproc-per-node 2 benchmarks/lab/profile_ring.py [--tokens 4096]
        [--mode token|expert] [--steps 5] [--out PATH.jsonl] [--trace PATH.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    import torch
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    from benchmarks import ENV_CONFIG
    from benchmarks._dist import init_dist, make_inputs, qwen3
    from benchmarks.common import JsonlWriter, busy_us, host_syncs
    from relaymoe.ring import RingRuntime, ring_moe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU (default 4k)")
    ap.add_argument("--mode", default="token", choices=["token", "expert", "alltoall"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30, help="rows of the printed table")
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--untrusted",
        dest="trusted",
        action="store_false",
        help="validate the ids and agree on every call (the default for ring_moe; "
        "Megatron's dispatcher passes trusted=True)",
    )
    ap.add_argument("--cprofile", action="store_true", help="rank 0's host time by function")
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
    # one runtime for every step, as a dispatcher keeps one: a trusted call's agreement is
    # reused, and the copy engines' workspace kept (transport "auto" takes them within a node)
    runtime = RingRuntime(group)
    config = ENV_CONFIG.replace(mode=args.mode)

    def step():
        out = ring_moe(x, w13, w2, idx, probs, group=group, trusted=args.trusted, config=config,
                       runtime=runtime)  # fmt: skip
        out.backward(dy)
        for t in (x, w13, w2, probs):
            t.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    syncs = host_syncs(step)
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
    done = {}

    def ready(p):  # the events of the active cycle exist only inside this callback
        done["events"] = list(p.events())
        done["averages"] = p.key_averages()
        if args.trace and rank == 0:
            p.export_chrome_trace(args.trace)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=sched,
                 on_trace_ready=ready) as prof:  # fmt: skip
        for _ in range(2 + args.steps):
            step()
            torch.cuda.synchronize()
            dist.barrier()
            prof.step()
    if args.cprofile and rank == 0:  # where the host time goes, by Python function
        import cProfile
        import pstats

        cp = cProfile.Profile()
        cp.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        cp.disable()
        st = pstats.Stats(cp)
        st.sort_stats("tottime").print_stats(args.top)
        st.sort_stats("cumulative").print_stats(args.top)
    elif args.cprofile:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = done.get("events", [])
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
               if e.device_type == DeviceType.CUDA]  # fmt: skip
    ranges: dict[str, list[float]] = {}  # host time of relaymoe's ranges (per hop, agreement)
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith("relaymoe."):
            ranges.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    n_launch = sum(
        1
        for e in events
        if e.device_type == DeviceType.CPU
        and e.name
        in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    )
    n_memcpy = sum(1 for e in events if e.device_type == DeviceType.CPU and "Memcpy" in e.name)
    window = (max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)) if kernels else 0.0
    # NCCL kernels and the copy engine's symmetric-memory barrier spin while a peer is late
    busy = busy_us(kernels, exclude=("nccl", "Nccl", "barrier_kernel"))
    if rank == 0:
        print(f"[profile_ring] {shape.name} mode={args.mode} EP={world}: {wall_ms:.2f} ms per "
              f"step (host issue incl. syncs {host * 1e3 / args.steps:.2f} ms); GPU busy "
              f"{busy / 1e3 / args.steps:.2f} ms per step outside NCCL kernels, of a "
              f"{window / 1e3 / args.steps:.2f} ms profiled window per step")  # fmt: skip
        print(
            f"[profile_ring] per step: {n_launch / args.steps:.0f} kernel launches, "
            f"{n_memcpy / args.steps:.0f} memcpy calls"
        )
        for name, ts in sorted(ranges.items()):
            print(
                f"[profile_ring] host {name}: {len(ts) / args.steps:.0f} per step, mean "
                f"{sum(ts) / len(ts):.0f} us"
            )
        print(f"[profile_ring] host syncs in one step: {sum(syncs.values())}")
        for where, n in sorted(syncs.items()):
            print(f"    {n} x {where}")
        ka = done["averages"]
        print(ka.table(sort_by="device_time_total", row_limit=args.top))
        print(ka.table(sort_by="cpu_time_total", row_limit=args.top))
        if args.out:
            w = JsonlWriter(args.out)
            w.write({"bench": "profile_ring", "shape": shape.name, "ep": world,
                     "mode": args.mode, "op": "summary", "wall_ms_per_step": round(wall_ms, 3),
                     "host_issue_ms_per_step": round(host * 1e3 / args.steps, 3),
                     "gpu_busy_ms_per_step": round(busy / 1e3 / args.steps, 3),
                     "window_ms_per_step": round(window / 1e3 / args.steps, 3),
                     "launches_per_step": round(n_launch / args.steps, 1),
                     "memcpy_per_step": round(n_memcpy / args.steps, 1),
                     "host_us": {k: round(sum(v) / len(v), 1) for k, v in ranges.items()},
                     "host_syncs": syncs})  # fmt: skip
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
