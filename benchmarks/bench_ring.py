"""Ring MoE over EP=2 (torchrun, one GPU per rank): relaymoe's ring against all-to-all baselines.

Providers (one run, same inputs, bf16, qwen3-30b-a3b layer with T tokens per GPU):

* ``relaymoe_ring_<mode>[_nooverlap][_<transport>]``: ``ring_moe`` with mode expert / token /
  auto and transport nccl / copy_engine (no suffix: ``transport="auto"``);
* ``a2a_same_kernel``: ``ring_moe`` with ``RingConfig(mode="alltoall")``: the same fused
  kernels behind one all-to-all of index-dispatched tokens (a token goes once to each rank
  owning one of its experts), the partial outputs back, a deterministic gather-reduce;
* ``mcore_alltoall``: megatron-core ``MoELayer``, alltoall dispatcher, SequentialMLP experts,
  router included (as in the anchor: 44.3 ms, 7486 MiB peak over inputs on 2x H200).

Every relaymoe provider calls ``ring_moe(..., trusted=True)`` as Megatron's dispatcher does (ids
from a router: no validation, the ranks' agreement reused per input signature). Ring rows carry
the persistent copy-engine workspace (``symm_workspace_MiB``) and count it in
``peak_over_inputs_MiB`` (``peak_alloc_MiB``: the caching allocator's peak alone).

Timing uses a fixed number of iterations on every rank (an adaptive count could differ between
ranks and hang a collective) and reports the slowest rank's median. Ring rows also carry the hop
timeline: per-hop compute and transfer measured without overlap, the hop time with overlap, and
the hidden share ``(compute + transfer - hop) / transfer`` (first hops, final return excluded).
``--crossover`` adds expert vs token rows over T in {4k..64k} and I in {768, 2048} with the
volume model's prediction; ``--seq`` ring (auto and both forced modes) and both all-to-alls over
T (paper Fig. 9). Quick
mode runs reduced forms of both unless ``--no-crossover`` / ``--no-seq``.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ring.py [--quick] [--crossover]
        [--seq] [--only PROVIDER,...] [--out PATH.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1024 * 1024


def _memory(fwd, bwd):
    """(saved_for_bwd, peak_over_inputs) in MiB, the slowest... largest rank's."""
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fwd()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    bwd(out)
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    t = torch.tensor([saved / MiB, peak / MiB], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return round(float(t[0]), 1), round(float(t[1]), 1)


class _Layer:
    """Inputs and leaves of one measured layer; ``step`` = forward+backward, grads cleared."""

    def __init__(self, x, w13, w2, idx, probs, dy):
        self.x = x.detach().requires_grad_()
        self.w13 = w13.detach().requires_grad_()
        self.w2 = w2.detach().requires_grad_()
        self.idx, self.dy = idx, dy
        self.probs = probs.detach().requires_grad_()

    def clear(self):
        self.x.grad = self.w13.grad = self.w2.grad = self.probs.grad = None


def _summarize_timeline(tl_overlap, tl_serial):
    """Per-phase means over hops that carry a lead transfer (hop < R-1 fwd, 1..R-1 bwd...)."""
    fields = {}
    for phase in ("fwd", "bwd"):
        ser = [t for t in tl_serial if t.phase == phase and t.transfer_bytes > 0]
        ovl = [t for t in tl_overlap if t.phase == phase and t.transfer_bytes > 0]
        # the final trail-only return has no compute to hide under
        ser = [t for t in ser if t.compute_ms > 0]
        ovl = [t for t in ovl if t.compute_ms > 0]
        if not ser or not ovl:
            continue
        c = statistics.mean(t.compute_ms for t in ser)
        tr = statistics.mean(t.transfer_ms for t in ser)
        hop = statistics.mean(t.hop_ms for t in ovl)
        fields[f"{phase}_hop_compute_ms"] = round(c, 3)
        fields[f"{phase}_hop_transfer_ms"] = round(tr, 3)
        fields[f"{phase}_hop_overlap_ms"] = round(hop, 3)
        fields[f"{phase}_hop_MB"] = round(ser[0].transfer_bytes / 1e6, 1)
        if tr > 0:
            fields[f"{phase}_hidden"] = round(min(1.0, max(0.0, (c + tr - hop) / tr)), 3)
    fields["timeline"] = [
        dict(phase=t.phase, hop=t.hop, MB=round(t.transfer_bytes / 1e6, 1),
             compute_ms=round(t.compute_ms, 3), transfer_ms=round(t.transfer_ms, 3),
             hop_ms=round(t.hop_ms, 3))
        for t in tl_overlap
    ]  # fmt: skip
    return fields


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    from benchmarks import ENV_CONFIG
    from benchmarks._dist import Shape, build_mcore_alltoall, init_dist, make_inputs, qwen3
    from benchmarks._dist import timed_collective as _timed
    from benchmarks.common import JsonlWriter, moe_flops_fwd_bwd, print_table
    from relaymoe import cost
    from relaymoe.options import RING_MODES
    from relaymoe.ring import RingRuntime, record_timeline, resolved_problem, ring_moe
    from relaymoe.ring.faults import host_wait_mode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer providers and iterations")
    ap.add_argument("--crossover", action="store_true", help="expert/token over T and I")
    ap.add_argument("--no-crossover", action="store_true", help="skip it in --quick mode")
    ap.add_argument("--seq", action="store_true", help="ring vs all-to-alls over T (Fig. 9)")
    ap.add_argument("--no-seq", action="store_true", help="skip the T sweep in --quick mode")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated provider names to run (default: all), e.g. a2a_same_kernel",
    )
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per GPU (default 32k)")
    ap.add_argument(
        "--two-level",
        action="store_true",
        help="also each ring provider with the two-level schedule forced at one GPU per node "
        "(suffix _2lvl_g1; issue #18: equal to the flat ring within noise)",
    )
    ap.add_argument(
        "--node-batched",
        type=int,
        default=0,
        metavar="G",
        help="also the expert ring providers with schedule node_batched at G GPUs per node "
        "(suffix _nb_gG; NCCL only)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_ring.jsonl"))
    args = ap.parse_args(argv)

    rank, world, group = init_dist()
    if world < 2:  # a world of one would write ring rows under transport names it never used
        print("bench_ring.py measures expert parallelism: run it under torchrun with "
              f"--nproc-per-node >= 2 (this world has {world} rank)", file=sys.stderr)  # fmt: skip
        return 2
    warmup, reps = (2, 5) if args.quick else (3, 15)
    writer = JsonlWriter(args.out) if rank == 0 else None
    rows = []

    def emit(row):
        row = {"bench": "ring", "ep": world, **row}
        if writer is not None:
            row = writer.write(row)
            print({k: v for k, v in row.items() if k != "timeline"}, flush=True)
        rows.append(row)

    # one runtime for every row, as a model's layers on one group share a dispatcher's: the
    # copy-engine workspace grows to the largest pass, as in training
    runtime = RingRuntime(group)

    def overlapping(on: bool):
        """The environment's config with ``overlap=on`` (False: the sequential ring, each
        transfer after its compute)."""
        return ENV_CONFIG.replace(overlap=on)

    def ring_row(shape, layer, provider, mode, transport, overlap, extra=None, topo=None):
        _ring_row(shape, layer, provider, mode, transport, overlap, extra, topo)

    def _ring_row(shape, layer, provider, mode, transport, overlap, extra, topo):
        topo = topo or {}
        config = overlapping(overlap).replace(mode=mode, transport=transport, **topo)

        def fwd():
            return ring_moe(layer.x, layer.w13, layer.w2, layer.idx, layer.probs, group=group,
                            trusted=True, config=config, runtime=runtime)  # fmt: skip

        def bwd(out):
            out.backward(layer.dy)
            layer.clear()

        def step():
            bwd(fwd())

        problem = resolved_problem(layer.x, layer.w13, layer.w2, layer.idx, layer.probs,
                                   group=group, trusted=True, config=config,
                                   runtime=runtime)  # fmt: skip
        step()  # first call allocates the copy-engine workspace (persistent, reported below)
        saved, peak_alloc = _memory(fwd, bwd)
        symm = runtime.workspace_bytes() / MiB if problem.transport == "copy_engine" else 0.0
        peak = round(peak_alloc + symm, 1)
        ms = _timed(step, warmup, reps)
        with torch.no_grad():
            ms_fwd = _timed(fwd, warmup, reps)
        row = dict(
            provider=provider, shape=shape.name, ms_fwd_bwd=round(ms, 3), ms_fwd=round(ms_fwd, 3),
            tflops_fwd_bwd=round(moe_flops_fwd_bwd(shape.T, shape.K, shape.H, shape.I) / ms / 1e9,
                                 1),
            saved_for_bwd_MiB=saved, peak_over_inputs_MiB=peak, peak_alloc_MiB=peak_alloc,
            mode=problem.mode, transport=problem.transport, overlap=overlap,
            symm_workspace_MiB=round(symm, 1), schedule=topo.get("schedule", problem.schedule),
            gpus_per_node=topo.get("gpus_per_node", problem.gpus_per_node),
            host_wait=host_wait_mode(layer.x.device, config.host_wait),
        )  # fmt: skip
        if overlap and world > 1 and problem.mode != "alltoall":
            with record_timeline(runtime) as tl_o:
                step()
            sequential = config.replace(mode=problem.mode, transport=problem.transport,
                                        overlap=False)  # fmt: skip
            with record_timeline(runtime) as tl_s:
                bwd(ring_moe(layer.x, layer.w13, layer.w2, layer.idx, layer.probs, group=group,
                             trusted=True, config=sequential, runtime=runtime))  # fmt: skip
            row.update(_summarize_timeline(tl_o, tl_s))
        row.update(extra or {})
        emit(row)

    wanted = {p for p in args.only.split(",") if p}

    def guarded(label, fn, shape_name=None):
        if wanted and label not in wanted:
            return
        try:
            fn()
        except Exception as err:  # a failing provider must not stop the others
            if rank == 0:
                traceback.print_exc()
            emit(dict(provider=label, shape=shape_name or shape.name, error=repr(err)[:400]))
        torch.cuda.empty_cache()

    shape = qwen3(args.tokens)  # the shape (qwen3 T32k per GPU) in quick mode too
    x, w13, w2, idx, probs = make_inputs(shape, rank, world)
    dy = torch.randn_like(x)
    layer = _Layer(x, w13, w2, idx, probs, dy)

    ring_cfgs = [("auto", "auto", True)]
    for mode in ("expert", "token"):
        for tr in ("copy_engine", "nccl"):
            ring_cfgs.append((mode, tr, True))
    for mode in ("expert", "token") if not args.quick else ("expert",):
        for tr in ("copy_engine", "nccl") if not args.quick else ("copy_engine",):
            ring_cfgs.append((mode, tr, False))
    for mode, tr, ov in ring_cfgs:
        name = f"relaymoe_ring_{mode}" + ("" if ov else "_nooverlap")
        name += "" if tr == "auto" else f"_{tr}"
        guarded(name, lambda m=mode, t=tr, o=ov, n=name: ring_row(shape, layer, n, m, t, o))
        if args.two_level and ov:
            forced = {"schedule": "two_level", "gpus_per_node": 1}
            guarded(name + "_2lvl_g1", lambda m=mode, t=tr, n=name + "_2lvl_g1", f=forced:
                    ring_row(shape, layer, n, m, t, True, topo=f))  # fmt: skip
        if args.node_batched and ov and mode == "expert" and tr == "nccl":
            nb = {"schedule": "node_batched", "gpus_per_node": args.node_batched}
            n_nb = f"{name}_nb_g{args.node_batched}"
            guarded(n_nb, lambda m=mode, t=tr, n=n_nb, f=nb:
                    ring_row(shape, layer, n, m, t, True, topo=f))  # fmt: skip

    def baseline_row(provider, shape, fwd, bwd, extra=None):
        """Time and measure one all-to-all baseline's fwd+bwd and emit its row."""
        bwd(fwd())
        saved, peak = _memory(fwd, bwd)
        ms = _timed(lambda: bwd(fwd()), warmup, reps)
        with torch.no_grad():
            ms_fwd = _timed(fwd, warmup, reps)
        emit(dict(provider=provider, shape=shape.name, ms_fwd_bwd=round(ms, 3),
                  ms_fwd=round(ms_fwd, 3),
                  tflops_fwd_bwd=round(moe_flops_fwd_bwd(shape.T, shape.K, shape.H, shape.I)
                                       / ms / 1e9, 1),
                  saved_for_bwd_MiB=saved, peak_over_inputs_MiB=peak, **(extra or {})))  # fmt: skip

    def a2a(shape, layer):
        ring_row(shape, layer, "a2a_same_kernel", "alltoall", "auto", True)

    def mcore(shape, layer):
        mlayer = build_mcore_alltoall(shape, world)
        xm = layer.x.detach().view(shape.T // 8, 8, shape.H).requires_grad_()
        dym = layer.dy.view_as(xm)

        def bwd(out):
            out.backward(dym)
            xm.grad = None
            mlayer.zero_grad(set_to_none=True)

        baseline_row("mcore_alltoall", shape, lambda: mlayer(xm)[0], bwd,
                     {"note": "router included; SequentialMLP experts"})  # fmt: skip

    guarded("a2a_same_kernel", lambda: a2a(shape, layer))
    guarded("mcore_alltoall", lambda: mcore(shape, layer))
    layer = x = w13 = w2 = idx = probs = dy = None  # free the main shape's tensors
    torch.cuda.empty_cache()

    if args.crossover or (args.quick and not args.no_crossover):
        Ts = (
            [4096, 16384, 65536]
            if args.quick and not args.crossover
            else [4096, 8192, 16384, 32768, 65536]
        )
        for ffn in (768, 2048):
            for T in Ts:
                shape = Shape(f"qwen3_30b_a3b_T{T // 1024}k_I{ffn}", T, 128, 8, 2048, ffn)
                xs, a, b, ids, ps = make_inputs(shape, rank, world)
                lay = _Layer(xs, a, b, ids, ps, torch.randn_like(xs))
                sizes = dict(tokens=T, hidden=shape.H, ffn=ffn, num_local_experts=shape.E // world,
                             topk=shape.K, world=world, act_bytes=torch.bfloat16,
                             prob_bytes=ps.dtype)  # fmt: skip
                d = cost.dims(**sizes)
                extra = dict(
                    crossover=True,
                    model_preferred=cost.choose_mode(**sizes, modes=RING_MODES),
                    model_expert_MB=round(cost.hop_bytes("expert", d).step / 1e6, 1),
                    model_token_MB=round(cost.hop_bytes("token", d).step / 1e6, 1),
                )
                for mode in ("expert", "token"):
                    name = f"relaymoe_ring_{mode}"
                    guarded(name, lambda m=mode, n=name, s=shape, lay=lay, e=extra: ring_row(
                        s, lay, n, m, "auto", True, e))  # fmt: skip
                del lay, xs, a, b, ids, ps
                torch.cuda.empty_cache()

    if args.seq or (args.quick and not args.no_seq):
        # Paper Fig. 9 analog: ring (auto) and both all-to-alls over tokens per GPU at the qwen3
        # widths (T32k is the main shape above).
        sweep = [8192, 65536] if args.quick and not args.seq else [4096, 8192, 16384, 65536]
        for T in sorted(set(sweep) - {args.tokens}):
            shape = qwen3(T)
            xs, a, b, ids, ps = make_inputs(shape, rank, world)
            lay = _Layer(xs, a, b, ids, ps, torch.randn_like(xs))
            for mode in ("auto", "expert", "token"):
                name = f"relaymoe_ring_{mode}"
                guarded(name, lambda s=shape, lay=lay, m=mode, n=name: ring_row(
                    s, lay, n, m, "auto", True, {"seq_sweep": True}), shape.name)  # fmt: skip
            guarded("a2a_same_kernel", lambda s=shape, lay=lay: a2a(s, lay), shape.name)
            guarded("mcore_alltoall", lambda s=shape, lay=lay: mcore(s, lay), shape.name)
            del lay, xs, a, b, ids, ps
            torch.cuda.empty_cache()

    if rank == 0:
        print_table(
            rows,
            ["provider", "shape", "mode", "transport", "ms_fwd_bwd", "ms_fwd", "tflops_fwd_bwd",
             "peak_over_inputs_MiB", "saved_for_bwd_MiB", "fwd_hidden", "bwd_hidden", "error"],
        )  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
