"""Memory timeline of one MoE layer forward+backward, all-to-all vs ring (paper Figs. 3/4/6/7).

Each provider runs one warm-up step, then one forward+backward under
``torch.cuda.memory._record_memory_history``; the allocator trace becomes an allocated-bytes-over-
time curve (relative to what was allocated before the forward), with the forward/backward
boundary marked. Providers: ``mcore_alltoall`` (megatron-core MoELayer, alltoall dispatcher,
router included) and ``relaymoe_ring`` (``relaymoe.ring_moe``, mode auto). Under ``torchrun``
EP = world size; as a single process EP = 1.

Outputs (rank 0): ``memory_timeline.png`` next to ``--out`` and one row per provider
(``bench: memory_timeline``) with the peaks.
Usage: ``torchrun --nproc-per-node 2 benchmarks/memory_timeline.py [--quick] [--out PATH]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARK_BYTES = 777 * 1024 + 512  # an allocation size nothing else uses: the fwd/bwd boundary


def trace_curve(snapshot: dict, device: int) -> tuple[list[float], list[int], int | None]:
    """(time ms, allocated bytes relative to the start, index of the boundary marker)."""
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    t0 = None
    cur = 0
    xs, ys = [], []
    mark = None
    for i, ev in enumerate(events):
        action, size = ev.get("action"), int(ev.get("size", 0))
        if action == "alloc":
            cur += size
            if size == MARK_BYTES and mark is None:
                mark = len(xs)
        elif action == "free_completed":
            cur -= size
        else:
            continue
        t = ev.get("time_us")
        if t is None:
            t = i
        t0 = t if t0 is None else t0
        xs.append((t - t0) / 1e3)
        ys.append(cur)
    return xs, ys, mark


def run_provider(name: str, step_fwd, step_bwd, device: int) -> dict:
    import torch

    step_bwd(step_fwd())  # warm-up: autotuning, allocator segments, communicators
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        out = step_fwd()
        torch.cuda.synchronize()
        fwd_peak = torch.cuda.max_memory_allocated() - base
        marker = torch.empty(MARK_BYTES, dtype=torch.uint8, device="cuda")
        del marker
        step_bwd(out)
        del out
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    xs, ys, mark = trace_curve(snap, device)
    return {
        "provider": name,
        "peak_over_inputs_MiB": round(peak / 2**20, 1),
        "fwd_peak_over_inputs_MiB": round(fwd_peak / 2**20, 1),
        "trace_events": len(xs),
        "_curve": (xs, ys, mark),
    }


def plot(results: list[dict], shape: str, ep: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    ymax = max((max(r["_curve"][1], default=0) for r in results), default=0) / 2**30 * 1.1
    for ax, r in zip(axes[0], results, strict=True):
        xs, ys, mark = r["_curve"]
        ax.plot(xs, [y / 2**30 for y in ys], lw=1)
        if mark is not None and mark < len(xs):
            ax.axvline(xs[mark], color="k", ls="--", lw=0.8)
            ax.text(xs[mark], ymax * 0.95, " backward", fontsize=8)
        ax.set_title(f"{r['provider']}: peak {r['peak_over_inputs_MiB']:.0f} MiB")
        ax.set_xlabel("time (ms)" if xs and xs[-1] != len(xs) - 1 else "allocator event")
        ax.set_ylabel("allocated over inputs (GiB)")
        ax.set_ylim(0, max(ymax, 1e-3))
        ax.grid(alpha=0.3)
    fig.suptitle(f"One MoE layer fwd+bwd, {shape}, EP={ep} (paper Figs. 4/7 analog)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    import torch

    from benchmarks._dist import build_mcore_alltoall, init_dist, make_inputs, qwen3
    from benchmarks.common import JsonlWriter, print_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8k tokens per GPU (else 32k)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/memory_timeline.jsonl"))
    ap.add_argument("--providers", default="mcore_alltoall,relaymoe_ring")
    args = ap.parse_args(argv)

    rank, world, group = init_dist()
    shape = qwen3(8192 if args.quick else 32768)
    device = torch.cuda.current_device()
    x, w13, w2, idx, probs = make_inputs(shape, rank, world)
    dy = torch.randn_like(x)
    results = []
    layer = None
    for prov in args.providers.split(","):
        try:
            if prov == "relaymoe_ring":
                from benchmarks import ENV_CONFIG
                from relaymoe.ring import RingRuntime, ring_moe

                xs = x.detach().requires_grad_()
                w13p = w13.detach().requires_grad_()
                w2p = w2.detach().requires_grad_()
                pr = probs.detach().requires_grad_()
                # one runtime for every step, as a dispatcher keeps one (transport "auto" then
                # takes the copy engines within a node, their workspace kept across steps)
                runtime = RingRuntime(group)

                def fwd(xs=xs, w13p=w13p, w2p=w2p, pr=pr, runtime=runtime):
                    return ring_moe(
                        xs, w13p, w2p, idx, pr, group=group, config=ENV_CONFIG, runtime=runtime
                    )

            elif prov == "mcore_alltoall":
                layer = build_mcore_alltoall(shape, world)
                xs = x.detach().view(shape.T, 1, shape.H).requires_grad_()

                def fwd(layer=layer, xs=xs):
                    return layer(xs)[0]

            else:
                raise ValueError(f"unknown provider {prov!r}: use mcore_alltoall, relaymoe_ring")

            def bwd(out):
                out.backward(dy.view_as(out))

            res = run_provider(prov, fwd, bwd, device)
            results.append(res)
        except Exception as e:  # one provider failing must not hide the other's timeline
            if rank == 0:
                print(f"[memory_timeline] {prov} failed: {type(e).__name__}: {e}"[:600])
        finally:
            fwd = layer = xs = None  # drop this provider's tensors before the next one
            torch.cuda.empty_cache()
    if rank == 0 and results:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        png = out.with_suffix(".png")
        plot(results, shape.name, world, png)
        writer = JsonlWriter(out)
        rows = []
        for r in results:
            row = {k: v for k, v in r.items() if not k.startswith("_")}
            rows.append(
                writer.write(
                    {
                        "bench": "memory_timeline",
                        "shape": shape.name,
                        "ep": world,
                        **row,
                        "png": png.name,
                    }
                )
            )
        print_table(
            rows,
            [
                "provider",
                "shape",
                "ep",
                "fwd_peak_over_inputs_MiB",
                "peak_over_inputs_MiB",
                "trace_events",
            ],
        )
        print(f"[memory_timeline] wrote {png}")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
