"""relaymoe on a CPU, checked against the float64 oracle (run by scripts/run_example.sh).

    TRITON_INTERPRET=1 .venv/bin/python scripts/cpu_demo.py

Three checks, each printed as PASS or FAIL with its relative error and the bound it must meet
(``||got - oracle|| / ||oracle||``, fp32: 1e-5; CONTRIBUTING.md):

1. the routing index of a Qwen3-30B-A3B routing (128 experts, top-8) built by the Triton kernels
   (Triton's CPU interpreter) equals the torch build, bitwise;
2. ``moe_experts`` with the Triton kernels (gather-on-load grouped GEMMs, fused SwiGLU, gather-
   reduce combine) in fp32: the output and the gradients of x, w13, w2 and the probabilities;
3. ``ring_moe`` over a gloo process group of two ranks (two processes on this machine), expert
   mode and token mode: each rank's output and gradients, the expert weights' gradients
   gathered from every rank's tokens (the hops compute with the plain-torch backend, as
   ``backend="auto"`` does for CPU tensors; check 2 covers the kernels).

The exit status is 1 when any check fails. Takes about 15 seconds (the interpreter is slow).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():  # must precede the first triton.jit (relaymoe.kernels)
    os.environ.setdefault("TRITON_INTERPRET", "1")

F32_BOUND = 1e-5
RING_WORLD = 2
# A Qwen3-30B-A3B-like layer scaled down to what the interpreter runs in seconds.
T, H, I_FFN, E, K = 40, 32, 24, 8, 4


@dataclass(frozen=True)
class Check:
    name: str
    err: float  # relative error vs the oracle (0.0 for a bitwise check that holds)
    bound: float

    @property
    def ok(self) -> bool:
        return self.err <= self.bound  # NaN fails

    def line(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        if self.bound == 0:
            return f"{verdict}  {self.name:<60} {'bitwise equal' if self.ok else 'DIFFERS'}"
        return f"{verdict}  {self.name:<60} rel err {self.err:8.2e} <= {self.bound:.0e}"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        return float("nan")
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def problem(seed: int, tokens: int, experts: int = E):
    """Float64 inputs: x (T, H), w13 (E, 2I, H), w2 (E, H, I), idx (T, K), probs (T, K)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * I_FFN, H, generator=g, dtype=torch.float64) / H**0.5
    w2 = torch.randn(experts, H, I_FFN, generator=g, dtype=torch.float64) / I_FFN**0.5
    idx = torch.topk(torch.rand(tokens, experts, generator=g), K, dim=1).indices
    probs = torch.softmax(torch.randn(tokens, K, generator=g, dtype=torch.float64), dim=1)
    dy = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    return x, w13, w2, idx, probs, dy


def grads_of(fn, x, w13, w2, idx, probs, dy, dtype):
    """Output and (dx, dw13, dw2, dprobs) of ``fn`` on copies of the inputs in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w13, w2, probs)]
    y = fn(leaves[0], leaves[1], leaves[2], idx, leaves[3])
    y.backward(dy.to(dtype))
    return [y.detach()] + [t.grad for t in leaves]


def check_routing() -> list[Check]:
    from relaymoe.routing import build_routing_index

    experts, topk, tokens = 128, 8, 512
    g = torch.Generator().manual_seed(1)
    idx = torch.topk(torch.rand(tokens, experts, generator=g), topk, dim=1).indices
    t0 = time.perf_counter()
    tri = build_routing_index(idx, experts, impl="triton")
    ms = (time.perf_counter() - t0) * 1e3
    ref = build_routing_index(idx, experts, impl="torch")
    fields = ("expert_token_indices", "expert_token_offsets", "token_expert_indices")
    fields += ("token_index_map",)
    same = all(torch.equal(getattr(tri, f), getattr(ref, f)) for f in fields)
    name = f"routing index Triton vs torch, T={tokens} E={experts} K={topk} ({ms:.0f} ms)"
    return [Check(name, 0.0 if same else float("inf"), 0.0)]


def check_triton_experts() -> list[Check]:
    from relaymoe.experts import moe_experts
    from relaymoe.reference import moe_experts_reference

    x, w13, w2, idx, probs, dy = problem(2, T)
    tri = lambda *a: moe_experts(*a, backend="triton")  # noqa: E731
    got = grads_of(tri, x, w13, w2, idx, probs, dy, torch.float32)
    ref = grads_of(moe_experts_reference, x, w13, w2, idx, probs, dy, torch.float64)
    shape = f"T={T} H={H} I={I_FFN} E={E} K={K}"
    names = ("output", "dx", "dw13", "dw2", "dprobs")
    return [
        Check(f"moe_experts Triton fp32 {shape}: {n}", rel_err(a, b), F32_BOUND)
        for n, a, b in zip(names, got, ref, strict=True)
    ]


# ---------------------------------------------------------------------------- ring, gloo world 2
def _ring_rank(rank: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    from relaymoe.options import RingConfig
    from relaymoe.reference import moe_experts_reference
    from relaymoe.ring import ring_moe

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RING_WORLD
    )
    # Every rank draws every rank's tokens from one seed: the oracle needs all of them for the
    # expert weights' gradients, which gather contributions from every rank's tokens.
    tokens = [T - 17, T + 5]  # uneven on purpose
    parts = [problem(10 + r, n) for r, n in enumerate(tokens)]
    _, w13, w2, _, _, _ = problem(3, 1)  # the experts all ranks share
    el = E // RING_WORLD
    mine = slice(rank * el, (rank + 1) * el)
    x, _, _, idx, probs, dy = parts[rank]
    results = {}
    for mode in ("expert", "token"):
        leaves = [t.detach().float().requires_grad_() for t in (x, w13[mine], w2[mine], probs)]
        config = RingConfig(mode=mode)
        y = ring_moe(leaves[0], leaves[1], leaves[2], idx, leaves[3], config=config)
        y.backward(dy.float())
        # the oracle over all ranks' tokens with all experts, in float64
        ref_leaves = [w13.clone().requires_grad_(), w2.clone().requires_grad_()]
        ref_x = [p[0].clone().requires_grad_() for p in parts]
        ref_p = [p[4].clone().requires_grad_() for p in parts]
        ref_y = [
            moe_experts_reference(ref_x[r], ref_leaves[0], ref_leaves[1], parts[r][3], ref_p[r])
            for r in range(RING_WORLD)
        ]
        torch.autograd.backward(ref_y, [p[5] for p in parts])
        pairs = {
            "output": (y.detach(), ref_y[rank].detach()),
            "dx": (leaves[0].grad, ref_x[rank].grad),
            "dw13 (local experts)": (leaves[1].grad, ref_leaves[0].grad[mine]),
            "dw2 (local experts)": (leaves[2].grad, ref_leaves[1].grad[mine]),
            "dprobs": (leaves[3].grad, ref_p[rank].grad),
        }
        for name, (a, b) in pairs.items():
            results[f"{mode} mode, rank {rank}: {name}"] = rel_err(a, b)
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def check_ring(timeout_s: float = 180.0) -> list[Check]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_ring_rank, args=(r, port, outdir)) for r in range(RING_WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        checks = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
            path = os.path.join(outdir, f"rank{r}.pt")
            if p.exitcode != 0 or not os.path.exists(path):
                why = "timed out" if p.exitcode is None or p.exitcode < 0 else f"exit {p.exitcode}"
                checks.append(Check(f"ring_moe rank {r} ({why})", float("nan"), F32_BOUND))
                continue
            for name, err in torch.load(path).items():
                checks.append(Check(f"ring_moe gloo x{RING_WORLD}, {name}", err, F32_BOUND))
    return checks


def main() -> int:
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    where = "Triton's CPU interpreter" if interp else "the GPU"
    print(f"relaymoe vs the float64 oracle (Triton kernels in {where}; fp32 bound {F32_BOUND:.0e})")
    checks: list[Check] = []
    for title, fn in (
        ("routing index", check_routing),
        ("fused expert kernels", check_triton_experts),
        (f"ring over a gloo group of {RING_WORLD} processes", check_ring),
    ):
        t0 = time.perf_counter()
        print(f"== {title}")
        got = fn()
        for c in got:
            print(f"  {c.line()}")
        print(f"  ({time.perf_counter() - t0:.1f} s)")
        checks += got
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"FAIL: {len(failed)} of {len(checks)} checks exceed their bound")
        return 1
    print(f"PASS: all {len(checks)} checks within their bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
