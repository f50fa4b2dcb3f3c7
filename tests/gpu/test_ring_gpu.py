"""ring_moe on 2 GPUs (NCCL process group): nccl and copy_engine transports, both modes, bf16,
against the float64 oracle. Skipped without 2 CUDA devices; run by ``scripts/gpu_suite.sh``.

Two spawned ranks run every check in one world (bf16 bound 1e-2, CONTRIBUTING.md): uneven and
zero token counts, overlap on and off, the hop timeline, bitwise determinism, and a ValueError
on both ranks for a bad input followed by a good call (nothing hangs, the group stays in step).
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

BF16_BOUND = 1e-2
H, I, EL, K = 1024, 512, 4, 4


def _problem(seed, tokens, route="uniform"):
    g = torch.Generator().manual_seed(seed)
    E, total = 2 * EL, sum(tokens)
    f64 = torch.float64
    idx = torch.rand(total, E, generator=g).argsort(1)[:, :K]
    if route == "skew":  # experts 0..K only: the other experts stay empty
        idx = torch.stack([torch.randperm(K + 1, generator=g)[:K] for _ in range(total)])
    return dict(
        x=torch.randn(total, H, generator=g, dtype=f64),
        w13=torch.randn(E, 2 * I, H, generator=g, dtype=f64) / H**0.5,
        w2=torch.randn(E, H, I, generator=g, dtype=f64) / I**0.5,
        idx=idx,
        probs=torch.rand(total, K, generator=g, dtype=f64),
        dy=torch.randn(total, H, generator=g, dtype=f64),
    )


def _rel(a, b):
    if b.numel() == 0:
        return 0.0
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _case(rank, dev, *, transport, mode, tokens, overlap=True, route="uniform", seed=0):
    from relaymoe.reference import moe_experts_reference
    from relaymoe.ring import ring_moe

    pb = {k: v.to(dev) for k, v in _problem(seed, tokens, route).items()}
    leaves = {k: pb[k].clone().requires_grad_() for k in ("x", "w13", "w2", "probs")}
    ref = moe_experts_reference(
        leaves["x"], leaves["w13"], leaves["w2"], pb["idx"], leaves["probs"]
    )
    ref.backward(pb["dy"])
    lo, hi = sum(tokens[:rank]), sum(tokens[: rank + 1])
    e0, e1 = rank * EL, (rank + 1) * EL
    bf = torch.bfloat16
    x = pb["x"][lo:hi].to(bf).requires_grad_()
    w13 = pb["w13"][e0:e1].to(bf).requires_grad_()
    w2 = pb["w2"][e0:e1].to(bf).requires_grad_()
    probs = pb["probs"][lo:hi].float().requires_grad_()
    out = ring_moe(x, w13, w2, pb["idx"][lo:hi], probs, mode=mode, transport=transport,
                   overlap=overlap)  # fmt: skip
    out.backward(pb["dy"][lo:hi].to(bf))
    what = f"{transport} {mode} tokens={tokens} overlap={overlap} route={route} rank={rank}"
    for name, got, want in [
        ("out", out, ref[lo:hi]),
        ("dx", x.grad, leaves["x"].grad[lo:hi]),
        ("dprobs", probs.grad, leaves["probs"].grad[lo:hi]),
        ("dw13", w13.grad, leaves["w13"].grad[e0:e1]),
        ("dw2", w2.grad, leaves["w2"].grad[e0:e1]),
    ]:
        assert torch.isfinite(got).all(), f"{name} not finite: {what}"
        assert _rel(got, want) < BF16_BOUND, f"{name} rel err {_rel(got, want):.3g}: {what}"
    return out.detach(), (x.grad, probs.grad, w13.grad, w2.grad)


def _worker(rank, port, outdir):
    results = {}
    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=60),
            device_id=dev,
        )
        from relaymoe.ring import record_timeline, ring_moe

        def run(name, fn):
            try:
                fn()
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()

        for transport in ("nccl", "copy_engine"):
            for mode in ("expert", "token"):
                run(f"{transport}_{mode}", lambda t=transport, m=mode: _case(
                    rank, dev, transport=t, mode=m, tokens=[3000, 1234], seed=1))  # fmt: skip
            run(f"{transport}_zero_tokens_nooverlap", lambda t=transport: [
                _case(rank, dev, transport=t, mode=m, tokens=[0, 2001], overlap=False,
                      route="skew", seed=2) for m in ("expert", "token")])  # fmt: skip

        def timeline():
            with record_timeline() as tl:
                _case(rank, dev, transport="copy_engine", mode="expert", tokens=[512, 512])
            phases = {(t.phase, t.hop) for t in tl}
            assert {("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1), ("bwd", 2)} <= phases, phases
            assert all(t.compute_ms >= 0 and t.hop_ms > 0 for t in tl), tl

        run("timeline", timeline)

        def determinism():
            for t in ("nccl", "copy_engine"):
                a = _case(rank, dev, transport=t, mode="token", tokens=[900, 700], seed=5)
                b = _case(rank, dev, transport=t, mode="token", tokens=[900, 700], seed=5)
                assert torch.equal(a[0], b[0]), t
                assert all(torch.equal(u, v) for u, v in zip(a[1], b[1], strict=True)), t

        run("determinism", determinism)

        def bad_input():
            x = torch.randn(8, H, device=dev, dtype=torch.bfloat16)
            w13 = torch.randn(EL, 2 * I, H, device=dev, dtype=torch.bfloat16)
            w2 = torch.randn(EL, H, I, device=dev, dtype=torch.bfloat16)
            idx = torch.zeros(8, 1, dtype=torch.long, device=dev)
            if rank == 1:
                idx[3, 0] = 2 * EL  # out of range on rank 1 only
            try:
                ring_moe(x, w13, w2, idx, torch.ones(8, 1, device=dev), transport="copy_engine")
            except ValueError as err:
                assert "rank 1" in str(err), err
            else:
                raise AssertionError("no ValueError")
            _case(rank, dev, transport="copy_engine", mode="expert", tokens=[64, 64], seed=9)

        run("bad_input", bad_input)
        dist.destroy_process_group()
    except Exception:
        results["setup"] = traceback.format_exc()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(results))


def test_ring_moe_two_gpus(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung"
    failures = []
    for r in range(2):
        f = Path(tmp_path, f"rank{r}.json")
        assert f.exists(), f"rank {r} died (exit code {procs[r].exitcode})"
        res = json.loads(f.read_text())
        failures += [f"rank {r} {k}:\n{v}" for k, v in res.items() if v != "ok"]
    assert not failures, "\n".join(failures)
