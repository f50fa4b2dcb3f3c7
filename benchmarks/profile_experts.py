"""Where one MoE expert layer's fwd+bwd spends its time on the GPU (``bench_experts.py
--profile``): kernels by name, the host's share, and the GPU's idle gaps (issue #15)."""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_experts import SHAPES, clear_grads, make_inputs
from benchmarks.common import host_syncs
from relaymoe.activation import SWIGLU


def profile_step(shape: str, fn, steps: int = 5, activation=None) -> tuple[list, dict]:
    """torch.profiler over ``steps`` fwd+bwd steps of ``fn`` (a bench_experts provider) at
    ``shape``, gradients cleared each step: GPU time per step by kernel name (rows), and the
    step's wall time against the sum of its kernels' times (the rest is launch gaps and host
    waits), the host's time to issue a step, one step's host syncs by where they happen, and
    the GPU's idle time between kernels by the kernels around it. Prints the host's time by
    function (cProfile). ``activation`` (an ``ExpertActivation``; None: SwiGLU) sizes the
    inputs (``w13`` has ``I`` rows per expert when not gated); it is the one ``fn`` computes."""
    inputs = make_inputs(*SHAPES[shape], activation=activation or SWIGLU)
    dy = torch.randn_like(inputs[0])

    def step():
        fn(*inputs).backward(dy)
        clear_grads(inputs)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    syncs = host_syncs(step)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host = 0.0
    for _ in range(steps):
        h0 = time.perf_counter()
        step()
        host += time.perf_counter() - h0  # host time to issue a step (the GPU may lag behind)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    cp = cProfile.Profile()  # where the host's time goes, by Python function
    cp.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    cp.disable()
    pstats.Stats(cp).sort_stats("tottime").print_stats(25)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)  # fmt: skip
    for a, b, name in spans:
        per_name.setdefault(name, []).append(b - a)
    # the GPU's idle time between consecutive kernels, summed by the pair of kernels around it
    idle: dict[str, float] = {}
    for (_, b0, n0), (a1, _, n1) in zip(spans, spans[1:], strict=False):
        if a1 > b0:
            key = f"{n0[:40]} -> {n1[:40]}"
            idle[key] = idle.get(key, 0.0) + (a1 - b0) / steps
    rows = sorted(({"kernel": k[:90], "calls_per_step": len(v) / steps,
                    "us_per_step": round(sum(v) / steps, 1)} for k, v in per_name.items()),
                  key=lambda r: -r["us_per_step"])  # fmt: skip
    busy_ms = sum(r["us_per_step"] for r in rows) / 1e3
    # the GPU's whole span (first start to last end) and its idle time in it, per step: wall_ms
    # also holds the host's head start before the first kernel
    span_ms = (spans[-1][1] - spans[0][0]) / 1e3 / steps if spans else 0.0
    summary = {"wall_ms": round(wall_ms, 3), "host_ms": round(host * 1e3 / steps, 3),
               "kernels_ms": round(busy_ms, 3), "span_ms": round(span_ms, 3),
               "idle_ms": round(sum(idle.values()) / 1e3, 3),
               "gap_ms": round(wall_ms - busy_ms, 3), "host_syncs": syncs,
               "idle_us_per_step": {k: round(v, 1) for k, v in
                                    sorted(idle.items(), key=lambda kv: -kv[1])[:12]}}  # fmt: skip
    return rows, summary
