"""The language-model loss, forward+backward, bf16 on one GPU: relaymoe vs Megatron vs Liger.

Providers (one process, same inputs; V=151936, TP=1; H=2048, or 4096 for ``T64k_H4k``):
- ``relaymoe``: ``relaymoe.linear_cross_entropy`` in its default mode (chunked output layer +
  cross-entropy, ``impl="auto"``, i.e. the Triton row kernels on CUDA; the weight gradient
  returned to autograd); masked tokens carry ``ignore_index``;
- ``relaymoe_accumulate``: its accumulate mode, as Megatron's fused loss runs it under gradient
  accumulation fusion: the weight gradient added into an fp32 accumulator (``main_grad``) that
  exists before the call, ``expected_grad`` the upstream gradient the loss sends (a device
  scalar), so the backward has nothing to correct;
- ``relaymoe_accumulate_miss``: the same with ``expected_grad`` 0.8 times the real one (the
  backward's correction: two more GEMMs a chunk);
- ``relaymoe_accumulate_noguess``: the accumulator without ``expected_grad`` (the backward
  computes the weight gradient: four GEMMs a chunk in all);
- ``megatron``: Megatron's output-layer GEMM (``linear_with_grad_accumulation_and_async_allreduce``
  at TP=1, no gradient-accumulation fusion: ``hidden @ weight.T`` in bf16, both GEMMs of its
  backward) then ``tensor_parallel.vocab_parallel_cross_entropy`` over a one-rank group;
- ``liger`` / ``liger_fp32``: Liger's ``liger_fused_linear_cross_entropy`` (functional, mean
  over the counted tokens; its weight gradient accumulated in bf16, or with
  ``accum_dtype=torch.float32``), where ``liger_kernel`` imports (skipped with the reason
  otherwise);
- ``relaymoe_torchimpl`` (only when asked): relaymoe with ``impl="torch"``.
Every backward takes the per-token upstream gradient a training loss gives,
``loss_mask / loss_mask.sum()`` (about 3% of tokens masked); Liger's mean is that loss.

Before timing a shape, each provider's loss and gradients are compared with Megatron's bf16
path (``err_*``; beyond ``AGREE_BOUND`` for a relaymoe provider the run exits 1 after writing
its rows) and with an fp32 reference (``err_*_fp32``: Megatron's cross-entropy on fp32 logits of
the same bf16 inputs, token chunk by token chunk, fp32 GEMMs without TF32). Fields, besides
those of ``benchmarks/README.md``: ``ms_fwd`` (the forward with autograd on, what training pays
before the backward), ``ms_eval`` (forward under no_grad), ``chunk_tokens``, ``impl``,
``wgrad`` (``relaymoe.lossmodel``'s mode), ``expected_grad``;
- ``peak_over_inputs_MiB``: the maximum allocated during forward+backward minus the allocation
  before it (inputs, labels, upstream gradient), gradients made fresh, all counted;
- ``transient_MiB``: the maximum allocated during forward+backward minus the allocation before
  it, where the weight's gradient exists before the call (``weight.grad`` allocated, or the
  accumulator: gradient accumulation), minus the hidden gradient the call returns;
- ``transient_chunk_MiB``: the same for a forward that wants no gradient (inputs detached,
  no_grad): the chunk working set (Megatron's: the whole logits and its fp32 buffers);
- ``transient_wgrad_MiB``: ``transient_MiB - transient_chunk_MiB``, what the gradients hold
  beyond the chunk (the default mode: its fp32 ``dW_unit``, the returned ``dW``, ``dh_unit``);
- ``predicted_peak_MiB`` / ``predicted_transient_MiB`` (relaymoe): ``relaymoe.lossmodel``.

Every relaymoe provider runs the library's default chunk for its mode and impl
(``relaymoe.lossmodel.default_chunk_tokens``; the accumulate modes' working set within
``TRANSIENT_BUDGET_MiB``), passed explicitly so that the row's ``chunk_tokens`` is what ran.

Timing: fresh gradients each step for the autograd providers (a training step's first
micro-batch); the accumulate providers add into their standing accumulator. ``ms_fwd`` of a
speculative provider forgets each forward's speculation (``reset_ledger``) to time it alone.

    PYTHONPATH=. python3 benchmarks/bench_loss.py [--shapes T16k T64k T64k_H4k] [--providers ...]
    python3 benchmarks/bench_loss.py --smoke      # tiny, CPU or GPU: checks the harness runs
"""

from __future__ import annotations

import argparse
import contextlib
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
from relaymoe.loss import linear_cross_entropy, reset_ledger  # noqa: E402
from relaymoe.loss.inputs import resolve_impl  # noqa: E402
from relaymoe.lossmodel import (  # noqa: E402
    ACCUMULATE_CHUNK_BUDGET_BYTES,
    default_chunk_tokens,
    fused_loss_bytes,
)

VOCAB, HIDDEN = 151936, 2048
SHAPES = {
    "T16k": (16384, VOCAB, HIDDEN),
    "T64k": (65536, VOCAB, HIDDEN),
    "T64k_H4k": (65536, VOCAB, 4096),  # issue #53's shape
}
SMOKE = {"smoke": (96, 1000, 64)}
IGNORE = -100
MASKED_FRACTION = 0.03
# bf16 against bf16: both round the logits and their gradient once; relaymoe accumulates the
# weight gradient over chunks in fp32, Megatron in one GEMM. Beyond this something is wrong.
AGREE_BOUND = 2e-2
TRANSIENT_BUDGET_MiB = ACCUMULATE_CHUNK_BUDGET_BYTES // MiB  # issue #53's target, the library's
FP32_REF_CHUNK = 4096  # tokens a chunk of the fp32 reference
RELAYMOE = ("relaymoe", "relaymoe_torchimpl", "relaymoe_accumulate", "relaymoe_accumulate_miss",
            "relaymoe_accumulate_noguess")  # fmt: skip
PROVIDERS = (*RELAYMOE, "megatron", "liger", "liger_fp32")
DEFAULT_PROVIDERS = ("relaymoe", "relaymoe_accumulate", "megatron")


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
# providers: forward, backward, where the weight gradient is, what exists before a call
# --------------------------------------------------------------------------------------------
class Autograd:
    """A provider whose weight gradient is autograd's ``weight.grad``."""

    per_token = True  # its forward returns the per-token loss (else the mean over the counted)
    meta: dict = {}

    def __init__(self, fn):
        self.fn = fn

    def forward(self, h, w):
        return self.fn(h, w)

    def backward(self, out, upstream):
        out.backward(upstream if self.per_token else None)

    def open(self, w):
        """Make the provider's gradient storage (an accumulator) exist."""

    def close(self):
        """Free it."""

    def weight_grad(self, w):
        return w.grad

    def clear(self, w):
        """Fresh gradients for the next timed step."""
        w.grad = None

    def zero(self, w):
        """No gradient accumulated yet (before a checked call)."""
        w.grad = None

    def preexisting(self, w):
        """The weight's gradient exists before the call (gradient accumulation)."""
        w.grad = torch.zeros_like(w)

    def forward_only(self, h, w):
        return self.forward(h, w)


class Accumulate(Autograd):
    """relaymoe's accumulate mode: an fp32 accumulator the weight gradient is added into."""

    def __init__(self, labels, impl, chunk, expected):
        super().__init__(None)
        self.labels, self.impl, self.chunk, self.expected = labels, impl, chunk, expected
        self.acc = None

    def forward(self, h, w):
        return linear_cross_entropy(h, w.detach(), self.labels, impl=self.impl,
                                    chunk_tokens=self.chunk, weight_grad_into=self.acc,
                                    expected_grad=self.expected)  # fmt: skip

    def open(self, w):
        self.acc = torch.zeros(w.shape, dtype=torch.float32, device=w.device)

    def close(self):
        self.acc = None

    def weight_grad(self, w):
        return self.acc

    def clear(self, w):
        pass  # the standing accumulator takes every step's gradient

    def zero(self, w):
        self.acc.zero_()

    def preexisting(self, w):
        pass  # it exists (open)

    def forward_only(self, h, w):
        out = self.forward(h, w)
        reset_ledger(self.acc)  # timing the forward alone: its speculation is forgotten
        return out


def wgrad_of(key: str) -> str:
    """Where a relaymoe provider's weight gradient goes (``relaymoe.lossmodel.WGRAD_MODES``)."""
    if key in ("relaymoe", "relaymoe_torchimpl"):
        return "kept"
    return "recompute" if key == "relaymoe_accumulate_noguess" else "accumulate"


def relaymoe_provider(key, labels, mask, impl, chunk):
    labels_ign = torch.where(mask, labels, IGNORE)
    mode = wgrad_of(key)
    if mode == "kept":
        p = Autograd(lambda h, w: linear_cross_entropy(h, w, labels_ign, impl=impl,
                                                       chunk_tokens=chunk))  # fmt: skip
        p.meta = {"wgrad": mode, "expected_grad": None}
        return p
    exact = 1.0 / mask.sum().clamp_min(1).float()  # the upstream every counted token gets
    expected = {"relaymoe_accumulate_miss": 0.8 * exact, "relaymoe_accumulate_noguess": None}
    p = Accumulate(labels_ign, impl, chunk, expected.get(key, exact))
    what = {"relaymoe_accumulate_miss": "0.8x", "relaymoe_accumulate_noguess": None}
    p.meta = {"wgrad": mode, "expected_grad": what.get(key, "exact")}
    return p


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


def liger_provider(key, labels, mask):
    """Liger's fused linear cross-entropy (mean over the counted tokens), or the reason why
    not."""
    if not torch.cuda.is_available():
        return "needs CUDA (Liger's kernels are Triton GPU kernels)"
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as exc:  # optional: its rows are skipped with the reason
        return f"liger_kernel unavailable: {exc!r}"
    labels_ign = torch.where(mask, labels, IGNORE)
    accum = torch.float32 if key == "liger_fp32" else None
    p = Autograd(lambda h, w: liger_fused_linear_cross_entropy(
        h, w, labels_ign, ignore_index=IGNORE, reduction="mean", accum_dtype=accum))  # fmt: skip
    p.per_token = False
    p.meta = {"accum_dtype": "float32" if accum else "bfloat16"}
    return p


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------
def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_over_bytes(run) -> int:
    """Bytes allocated at the peak of ``run()`` over what was allocated before it (CUDA)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def memory(p, h, w, upstream) -> dict:
    """``peak_over_inputs_MiB`` and the ``transient*`` fields (module doc); None on CPU."""
    keys = ("peak_over_inputs_MiB", "transient_MiB", "transient_chunk_MiB", "transient_wgrad_MiB")
    if not torch.cuda.is_available():
        return dict.fromkeys(keys)

    def step():
        p.backward(p.forward(h, w), upstream)

    p.zero(w)
    h.grad = None
    peak = peak_over_bytes(step)
    p.zero(w)
    h.grad = None
    p.preexisting(w)
    transient = peak_over_bytes(step) - h.grad.numel() * h.grad.element_size()
    with torch.no_grad():
        chunk = peak_over_bytes(lambda: p.forward(h.detach(), w.detach()))
    p.zero(w)
    h.grad = None
    vals = (peak, transient, chunk, transient - chunk)
    return {k: round(v / MiB, 1) for k, v in zip(keys, vals, strict=True)}


def measure(p, h, w, upstream, rep_ms) -> dict:
    for _ in range(2):  # compile Triton kernels, warm cuBLAS, outside the measured region
        p.backward(p.forward(h, w), upstream)
        p.clear(w)
        h.grad = None
    mem = memory(p, h, w, upstream)

    def step():
        p.clear(w)  # fresh gradients every step (accumulate: the standing accumulator)
        h.grad = None
        p.backward(p.forward(h, w), upstream)

    warm = max(100, rep_ms // 3)  # a T64k step takes ~0.2-0.8 s: at least one warm-up call
    ms = bench_ms(step, warmup_ms=warm, rep_ms=rep_ms)
    ms_fwd = bench_ms(lambda: p.forward_only(h, w), warmup_ms=warm, rep_ms=rep_ms)
    with torch.no_grad():
        ms_eval = bench_ms(lambda: p.forward(h, w), warmup_ms=warm, rep_ms=rep_ms)
    p.clear(w)
    h.grad = None
    return {"ms_fwd_bwd": round(ms, 3), "ms_fwd": round(ms_fwd, 3), "ms_eval": round(ms_eval, 3),
            **mem}  # fmt: skip


def _run(p, h, w, upstream):
    """(loss, dh, dW) of one checked call on fresh copies of the inputs."""
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    p.open(ww)
    p.zero(ww)
    out = p.forward(hh, ww)
    p.backward(out, upstream)
    dw = p.weight_grad(ww).detach().clone()
    p.close()
    return out.detach().float(), hh.grad, dw


@contextlib.contextmanager
def _no_tf32():
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def fp32_reference(h, w, labels, upstream, group):
    """(loss, dh, dW) in fp32: Megatron's cross-entropy on fp32 logits of the bf16 inputs,
    ``FP32_REF_CHUNK`` tokens at a time (the whole fp32 logits would not fit), fp32 GEMMs."""
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    tokens = h.shape[0]
    w32 = w.detach().float().requires_grad_()
    loss = torch.empty(tokens, device=h.device)
    dh = torch.empty(h.shape, device=h.device)
    with _no_tf32():
        for s in range(0, tokens, FP32_REF_CHUNK):
            e = min(s + FP32_REF_CHUNK, tokens)
            hc = h.detach()[s:e].float().requires_grad_()
            out = vocab_parallel_cross_entropy(hc @ w32.t(), labels[s:e], 0.0, group)
            out.backward(upstream[s:e])
            loss[s:e], dh[s:e] = out.detach(), hc.grad
    return loss, dh, w32.grad


def _errors(got, ref, mask, upstream, per_token, suffix) -> dict:
    names = ("loss", "dhidden", "dweight")
    ref_loss = torch.where(mask, ref[0], 0.0)
    if per_token:
        got = (torch.where(mask, got[0], 0.0), *got[1:])
    else:  # the mean over the counted tokens
        ref_loss = (ref_loss * upstream).sum()
    ref = (ref_loss, *ref[1:])
    return {f"err_{n}{suffix}": round(rel_err(a, b), 6)
            for n, a, b in zip(names, got, ref, strict=True)}  # fmt: skip


def check_errors(providers: dict, ref_fn, h, w, labels, mask, upstream, group) -> dict:
    """Each provider's ``err_*`` against Megatron's bf16 path and ``err_*_fp32`` against the
    fp32 reference."""
    ref = _run(Autograd(ref_fn), h, w, upstream)
    ref32 = fp32_reference(h, w, labels, upstream, group)
    checks = {}
    for key, p in {**providers, "megatron": Autograd(ref_fn)}.items():
        got = ref if key == "megatron" else _run(p, h, w, upstream)
        checks[key] = {} if key == "megatron" else _errors(got, ref, mask, upstream,
                                                           p.per_token, "")  # fmt: skip
        checks[key].update(_errors(got, ref32, mask, upstream, p.per_token, "_fp32"))
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


def _impl_of(key: str, device) -> str:
    """The impl a relaymoe provider runs on ``device`` (``resolve_impl``)."""
    return resolve_impl("torch" if key == "relaymoe_torchimpl" else "auto", torch.device(device))


def _relaymoe_fields(key, p, tokens, vocab, hidden, chunk, device) -> dict:
    impl = _impl_of(key, device)
    model = fused_loss_bytes(tokens, hidden, vocab, chunk_tokens=chunk, wgrad=p.meta["wgrad"],
                             impl=impl)  # fmt: skip
    return {"impl": impl, "chunk_tokens": min(chunk, tokens), **p.meta,
            "predicted_peak_MiB": round(model.peak / MiB, 1),
            "predicted_transient_MiB": round(model.transient / MiB, 1)}  # fmt: skip


def make_providers(wanted, labels, mask, tokens, vocab, hidden_dtype):
    """{key: provider} and {key: why it is skipped}; a relaymoe provider runs the library's
    default chunk for its mode and impl."""
    made, skipped = {}, {}
    for key in wanted:
        if key in RELAYMOE:
            impl = _impl_of(key, labels.device)
            chunk = default_chunk_tokens(tokens, vocab, wgrad=wgrad_of(key), impl=impl,
                                         act_bytes=hidden_dtype.itemsize)  # fmt: skip
            made[key] = relaymoe_provider(key, labels, mask, impl, chunk)
            made[key].chunk_tokens = chunk
        elif key.startswith("liger"):
            got = liger_provider(key, labels, mask)
            if isinstance(got, str):
                skipped[key] = got
            else:
                made[key] = got
    return made, skipped


def _summary(shape, shape_rows, vocab) -> None:
    by = {r["provider"]: r for r in shape_rows}
    base = by.get("relaymoe")
    for key, r in by.items():
        line = f"[bench_loss] {shape} {key}:"
        if base and key != "relaymoe":
            line += f" time {r['ms_fwd_bwd'] / base['ms_fwd_bwd']:.3f}x relaymoe;"
        if r.get("transient_MiB") is not None:
            ok = "within" if r["transient_MiB"] <= TRANSIENT_BUDGET_MiB else "OVER"
            line += (f" transient {r['transient_MiB']} MiB ({ok} {TRANSIENT_BUDGET_MiB}; chunk "
                     f"{r['transient_chunk_MiB']}, wgrad {r['transient_wgrad_MiB']})")  # fmt: skip
        print(line, flush=True)
    acc = by.get("relaymoe_accumulate")
    if acc and acc.get("transient_chunk_MiB") and acc["transient_chunk_MiB"] > TRANSIENT_BUDGET_MiB:
        print(f"[bench_loss] {shape}: the default chunk's working set alone "
              f"({acc['transient_chunk_MiB']} MiB at {acc['chunk_tokens']} tokens) exceeds "
              f"{TRANSIENT_BUDGET_MiB} MiB, the budget its chunk is sized for at V={vocab}: "
              "relaymoe.lossmodel.logit_bytes undercounts this run", flush=True)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None, choices=sorted(SHAPES))
    ap.add_argument("--providers", nargs="*", default=None, choices=PROVIDERS,
                    help=f"default: {' '.join(DEFAULT_PROVIDERS)}")  # fmt: skip
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
    shapes = SMOKE if args.smoke else {k: SHAPES[k] for k in (args.shapes or ("T16k", "T64k"))}
    wanted = list(args.providers or DEFAULT_PROVIDERS)
    rep_ms = 20 if args.smoke else args.rep_ms
    group, created = _one_rank_group()
    columns = ["provider", "shape", "ms_fwd_bwd", "ms_fwd", "tflops_fwd_bwd", "transient_MiB",
               "transient_chunk_MiB", "transient_wgrad_MiB", "predicted_transient_MiB",
               "peak_over_inputs_MiB", "err_dweight_fp32", "err_dhidden_fp32",
               "chunk_tokens"]  # fmt: skip
    rows, wrong = [], []
    try:
        for shape, (tokens, vocab, hidden) in shapes.items():
            h, w, labels, mask, upstream = make_inputs(tokens, vocab, hidden, device,
                                                       torch.bfloat16)  # fmt: skip
            provs, skipped = make_providers(wanted, labels, mask, tokens, vocab, h.dtype)
            for key, why in skipped.items():
                print(f"[bench_loss] {shape} {key} skipped: {why}", flush=True)
            ref_fn = megatron_fn(labels, group)
            checks = check_errors(provs, ref_fn, h, w, labels, mask, upstream, group)
            print(f"[bench_loss] {shape} errors: {checks}", flush=True)
            wrong += [f"{shape} {k} {n}={v}" for k, c in checks.items() if k in RELAYMOE
                      for n, v in c.items()
                      if not n.endswith("_fp32") and not v <= AGREE_BOUND]  # fmt: skip
            shape_rows = []
            for key in wanted:
                if key in skipped:
                    continue
                p = Autograd(ref_fn) if key == "megatron" else provs[key]
                p.open(w)
                try:
                    r = measure(p, h, w, upstream, rep_ms)
                except torch.cuda.OutOfMemoryError as exc:  # keep the other providers' rows
                    print(f"[bench_loss] {key} {shape} out of memory: {exc!r}", flush=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                finally:
                    p.close()
                row = {"bench": "loss", "provider": key, "shape": shape, "ep": 1, "tp": 1,
                       "tokens": tokens, "vocab": vocab, "hidden": hidden, **r,
                       "tflops_fwd_bwd": round(6.0 * tokens * vocab * hidden / r["ms_fwd_bwd"]
                                               / 1e9, 1), **checks.get(key, {})}  # fmt: skip
                if key in RELAYMOE:
                    row.update(_relaymoe_fields(key, p, tokens, vocab, hidden, p.chunk_tokens,
                                                device))  # fmt: skip
                elif key.startswith("liger"):
                    row.update(p.meta)
                shape_rows.append(writer.write(row))
                print(f"[bench_loss] {key} {shape} {r}", flush=True)
            rows += shape_rows
            print_table(shape_rows, columns)
            _summary(shape, shape_rows, vocab)
            del h, w, labels, mask, upstream, provs, ref_fn
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
