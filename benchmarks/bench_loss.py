"""The language-model loss, forward+backward, bf16 on one GPU: relaymoe vs Megatron.

Providers (one process, same inputs: V=151936, H=2048, TP=1):
- ``relaymoe``: ``relaymoe.linear_cross_entropy`` (chunked output layer + cross-entropy, default
  chunk and ``impl="auto"``, i.e. the Triton row kernels on CUDA); masked tokens carry
  ``ignore_index``.
- ``megatron``: Megatron's output-layer GEMM (``linear_with_grad_accumulation_and_async_allreduce``
  at TP=1, no gradient-accumulation fusion: ``hidden @ weight.T`` in bf16, both GEMMs of its
  backward) then ``tensor_parallel.vocab_parallel_cross_entropy`` over a one-rank group.
- ``relaymoe_torchimpl`` (only when asked): relaymoe with ``impl="torch"``.
Both backward with the per-token upstream gradient a training loss gives,
``loss_mask / loss_mask.sum()`` (about 3% of tokens masked).

Before timing a shape, relaymoe's loss and gradients are compared with Megatron's (``err_*``
keys); beyond ``AGREE_BOUND`` the run exits 1 after writing its rows. Fields, besides those of
``benchmarks/README.md``: ``ms_fwd`` (the forward with autograd on, what training pays before
the backward; relaymoe's does all three GEMMs there), ``ms_eval`` (forward under no_grad),
``chunk_tokens``, ``impl``, ``predicted_peak_MiB`` (relaymoe: ``relaymoe.lossmodel`` plus the
two returned gradients). ``peak_over_inputs_MiB`` is the maximum allocated during forward+backward
minus the allocation before it (inputs, labels, upstream gradient); the gradients count.

    PYTHONPATH=. python3 benchmarks/bench_loss.py [--shapes T16k T64k] [--out PATH.jsonl]
    python3 benchmarks/bench_loss.py --smoke      # tiny, CPU or GPU: checks the harness runs
"""

from __future__ import annotations

import argparse
import gc
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    JsonlWriter,
    MiB,
    bench_ms,
    environment,
    print_table,
    rel_err,
)
from relaymoe.loss import linear_cross_entropy  # noqa: E402
from relaymoe.lossmodel import default_chunk_tokens, fused_loss_bytes  # noqa: E402

VOCAB, HIDDEN = 151936, 2048
SHAPES = {"T16k": (16384, VOCAB, HIDDEN), "T64k": (65536, VOCAB, HIDDEN)}
SMOKE = {"smoke": (96, 1000, 64)}
IGNORE = -100
MASKED_FRACTION = 0.03
# bf16 against bf16: both round the logits and their gradient once; relaymoe accumulates the
# weight gradient over chunks in fp32, Megatron in one GEMM. Beyond this something is wrong.
AGREE_BOUND = 2e-2


def make_inputs(tokens, vocab, hidden, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * hidden**-0.5).to(dtype)
    w.requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    mask = torch.rand(tokens, device=device, generator=gen) >= MASKED_FRACTION
    upstream = mask.float() / mask.sum().clamp_min(1)  # loss-mask-times-constant
    return h, w, labels, mask, upstream


# --------------------------------------------------------------------------------------------
# providers: fn(hidden, weight) -> loss_T
# --------------------------------------------------------------------------------------------
def relaymoe_fn(labels, mask, impl):
    labels_ign = torch.where(mask, labels, IGNORE)
    return lambda h, w: linear_cross_entropy(h, w, labels_ign, impl=impl)


def megatron_fn(labels, group):
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.layers import (
        linear_with_grad_accumulation_and_async_allreduce,
    )

    def fn(h, w):
        logits = linear_with_grad_accumulation_and_async_allreduce(
            h, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=False, tp_group=group,
        )  # fmt: skip
        return vocab_parallel_cross_entropy(logits, labels, 0.0, group)

    return fn


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------
def _clear(*ts):
    for t in ts:
        t.grad = None


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn, h, w, upstream, rep_ms) -> dict:
    for _ in range(2):  # compile Triton kernels, warm cuBLAS, outside the measured region
        fn(h, w).backward(upstream)
        _clear(h, w)
    gc.collect()
    peak = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(h, w).backward(upstream)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / MiB
        _clear(h, w)

    def step():
        _clear(h, w)  # fresh gradients every step, as a training step's first micro-batch
        fn(h, w).backward(upstream)

    warm = max(100, rep_ms // 3)  # a T64k step takes ~0.2-0.4 s: at least one warm-up call
    ms = bench_ms(step, warmup_ms=warm, rep_ms=rep_ms)
    ms_fwd = bench_ms(lambda: fn(h, w), warmup_ms=warm, rep_ms=rep_ms)
    with torch.no_grad():
        ms_eval = bench_ms(lambda: fn(h, w), warmup_ms=warm, rep_ms=rep_ms)
    _clear(h, w)
    return {
        "ms_fwd_bwd": round(ms, 3),
        "ms_fwd": round(ms_fwd, 3),
        "ms_eval": round(ms_eval, 3),
        "peak_over_inputs_MiB": None if peak is None else round(peak, 1),
    }


def check_against_megatron(fns: dict, ref_fn, h, w, mask, upstream) -> dict:
    def run(fn):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = fn(hh, ww)
        loss.backward(upstream)
        return torch.where(mask, loss.detach().float(), 0.0), hh.grad, ww.grad

    ref = run(ref_fn)
    checks = {}
    for key, fn in fns.items():
        got = run(fn)
        names = ("loss", "dhidden", "dweight")
        checks[key] = {
            f"err_{n}": round(rel_err(a, b), 6) for n, a, b in zip(names, got, ref, strict=True)
        }
        del got
    return checks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_rank_group():
    """(group, created): a one-rank process group for Megatron's TP=1 calls (NCCL on CUDA)."""
    if dist.is_initialized():
        return dist.new_group([dist.get_rank()]), False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    return dist.new_group([0]), True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None, choices=sorted(SHAPES))
    ap.add_argument(
        "--providers",
        nargs="*",
        default=None,
        help="relaymoe megatron relaymoe_torchimpl (default: relaymoe megatron)",
    )
    ap.add_argument("--out", default=None, help="JSONL path (default benchmarks/results/...)")
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--smoke", action="store_true",
                    help="one tiny shape (T=96, V=1000, H=64), on CPU without CUDA")  # fmt: skip
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench_loss needs CUDA (or --smoke)")
        return 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()
    out = args.out or f"benchmarks/results/loss_{env['date']}.jsonl"
    writer = JsonlWriter(out, env=env)
    shapes = SMOKE if args.smoke else {k: SHAPES[k] for k in (args.shapes or list(SHAPES))}
    wanted = args.providers or ["relaymoe", "megatron"]
    unknown = sorted(set(wanted) - {"relaymoe", "megatron", "relaymoe_torchimpl"})
    if unknown:
        ap.error(f"unknown providers {unknown}")
    rep_ms = 20 if args.smoke else args.rep_ms
    group, created = _one_rank_group()
    columns = ["provider", "shape", "ms_fwd_bwd", "ms_fwd", "ms_eval", "tflops_fwd_bwd",
               "peak_over_inputs_MiB", "predicted_peak_MiB", "chunk_tokens", "impl"]  # fmt: skip
    rows, wrong = [], []
    try:
        for shape, (tokens, vocab, hidden) in shapes.items():
            h, w, labels, mask, upstream = make_inputs(tokens, vocab, hidden, device,
                                                       torch.bfloat16)  # fmt: skip
            chunk = default_chunk_tokens(tokens, vocab)
            impls = {"relaymoe": "auto", "relaymoe_torchimpl": "torch"}
            fns = {k: relaymoe_fn(labels, mask, impls[k]) for k in wanted if k in impls}
            ref_fn = megatron_fn(labels, group)
            checks = check_against_megatron(fns, ref_fn, h, w, mask, upstream)
            print(f"[bench_loss] {shape} vs megatron: {checks}", flush=True)
            wrong += [f"{shape} {k} {n}={v}" for k, c in checks.items() for n, v in c.items()
                      if not v <= AGREE_BOUND]  # fmt: skip
            predicted = fused_loss_bytes(tokens, hidden, vocab).total + 2 * (
                tokens * hidden + vocab * hidden
            )  # + the returned bf16 gradients
            shape_rows = []
            for key in wanted:
                fn = ref_fn if key == "megatron" else fns[key]
                try:
                    r = measure(fn, h, w, upstream, rep_ms)
                except torch.cuda.OutOfMemoryError as exc:  # keep the other provider's row
                    print(f"[bench_loss] {key} {shape} out of memory: {exc!r}", flush=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                row = {"bench": "loss", "provider": key, "shape": shape, "ep": 1, "tp": 1,
                       "tokens": tokens, "vocab": vocab, "hidden": hidden, **r,
                       "tflops_fwd_bwd": round(6.0 * tokens * vocab * hidden / r["ms_fwd_bwd"]
                                               / 1e9, 1)}  # fmt: skip
                if key in impls:
                    from relaymoe.loss.inputs import _resolve_impl

                    row["impl"] = _resolve_impl(impls[key], h.device)
                    row["chunk_tokens"] = chunk
                    row["predicted_peak_MiB"] = round(predicted / MiB, 1)
                    row.update(checks[key])
                shape_rows.append(writer.write(row))
                print(f"[bench_loss] {key} {shape} {r}", flush=True)
            rows += shape_rows
            print_table(shape_rows, columns)
            by = {r["provider"]: r for r in shape_rows}
            if "relaymoe" in by and "megatron" in by:
                rm, mg = by["relaymoe"], by["megatron"]
                line = f"{shape}: relaymoe time {rm['ms_fwd_bwd'] / mg['ms_fwd_bwd']:.3f}x megatron"
                if rm["peak_over_inputs_MiB"] is not None:
                    ratio = rm["peak_over_inputs_MiB"] / mg["peak_over_inputs_MiB"]
                    line += f", peak {ratio:.3f}x"
                print(line, flush=True)
            del h, w, labels, mask, upstream, fns, ref_fn
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        if created:
            dist.destroy_process_group()
    if len(shapes) > 1:
        print_table(rows, columns)
    if wrong:
        print(f"[bench_loss] disagree with megatron beyond {AGREE_BOUND}: {wrong}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
