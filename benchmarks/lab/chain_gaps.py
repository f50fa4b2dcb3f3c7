"""Where the GPU waits inside passes issued back to back: hop_cost's library pass under
torch.profiler, chained (no sync between passes) and isolated (a sync before each), with the
longest gaps between consecutive device ops and what borders them.

    python benchmarks/lab/chain_gaps.py [--mode expert] [--direction fwd] [--ep 64] [--tokens 4096]
        [--passes 4] [--top 12] [--eager] [--out PATH.jsonl]

A diagnostic for hop_cost's ``idle_frac_chained`` (issue #34): rows ``bench: chain_gaps`` per
way of issuing (``chained``, ``isolated``): device busy and span per pass, idle share, the gap
histogram (us: <2, 2-5, 5-20, 20-100, >=100, summed) and the ``--top`` longest gaps with the
device ops before and after them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from benchmarks.common import JsonlWriter, environment  # noqa: E402
from benchmarks.lab import hop_cost, hop_library  # noqa: E402

BINS = ((0, 2), (2, 5), (5, 20), (20, 100), (100, float("inf")))


def gaps(events, passes: int, top: int) -> dict:
    """Busy, span and gaps of the device ops in ``events`` (profiler events)."""
    from torch.autograd import DeviceType

    dev = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if e.device_type == DeviceType.CUDA)  # fmt: skip
    if not dev:
        return {}
    busy, out, end, last = 0.0, [], dev[0][0], dev[0]
    for a, b, name in dev:
        if a > end:
            out.append((a - end, last[2], name))
        busy += max(0.0, b - max(a, end))
        if b > end:
            end, last = b, (a, b, name)
    span = end - dev[0][0]
    hist = {f"{lo}-{hi}": round(sum(g for g, _, _ in out if lo <= g < hi) / passes, 1)
            for lo, hi in BINS}  # fmt: skip
    out.sort(reverse=True)
    return {
        "busy_us_per_pass": round(busy / passes, 1),
        "span_us_per_pass": round(span / passes, 1),
        "idle_frac": round(1 - busy / span, 3) if span else None,
        "gap_us_per_pass_by_size": hist,
        "gaps_per_pass": round(len(out) / passes, 1),
        "top_gaps": [
            {"us": round(g, 1), "after": x[:60], "before": y[:60]} for g, x, y in out[:top]
        ],  # fmt: skip
    }


def profiled(run, n: int, chained: bool, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            if not chained:
                torch.cuda.synchronize()
            run()
        torch.cuda.synchronize()
    return gaps(list(prof.events()), n, top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="expert", choices=hop_cost.MODES)
    ap.add_argument("--direction", default="fwd", choices=hop_cost.DIRECTIONS)
    ap.add_argument("--ep", type=int, nargs="+", default=[64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--eager", action="store_true", help="the eager pass, not the library's")
    ap.add_argument("--out", default=None, help="JSONL path")
    a = ap.parse_args(argv)
    a.quick, a.tiny, a.backend, a.modes = False, False, "auto", [a.mode]
    env = environment()
    writer = JsonlWriter(a.out or f"benchmarks/results/chain_gaps_{env['date']}.jsonl", env=env)
    group = hop_cost.init_group()
    for case in hop_cost.cases(a):
        ring = hop_cost.Ring(case, group=group)  # its own runtime: no case's hops in another's
        run = partial(ring.run, a.direction)
        with hop_library.capturing(ring) if not a.eager else contextlib.nullcontext():
            run()
            hop_library.settle(ring, a.direction, hop_library.STEADY_PASSES)
            for chained in (True, False):
                row = profiled(run, a.passes, chained, a.top)
                writer.write({"bench": "chain_gaps", "mode": case.mode, "direction": a.direction,
                              "ep": case.ep, "tokens": case.tokens, "eager": a.eager,
                              "issue": "chained" if chained else "isolated", **row})  # fmt: skip
                way = "chained" if chained else "isolated"
                head = f"{case.mode} {a.direction} EP {case.ep} T {case.tokens} {way}"
                print(
                    f"== {head}: busy {row['busy_us_per_pass']} "
                    f"span {row['span_us_per_pass']} idle {row['idle_frac']} "
                    f"gaps/pass {row['gaps_per_pass']} {row['gap_us_per_pass_by_size']}"
                )
                for g in row["top_gaps"]:
                    print(f"   {g['us']:8.1f} us  after {g['after']}  before {g['before']}")
        del ring
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
