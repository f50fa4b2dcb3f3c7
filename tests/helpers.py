"""Shared test inputs: routings of every kind and random MoE problems."""

from __future__ import annotations

import torch


def random_routing(num_tokens: int, num_experts: int, topk: int, *, gen=None, kind="uniform"):
    """(T, K) int64 distinct expert ids per row.

    kind: ``uniform``; ``skewed`` (about 80% of picks among 20% of experts); ``one`` (every row
    starts with expert 0); ``empty`` (the last expert never picked, needs K < E).
    """
    if kind == "uniform":
        scores = torch.rand(num_tokens, num_experts, generator=gen)
    elif kind == "skewed":
        hot = max(1, num_experts // 5)
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        scores[:, :hot] += 4.0 * (torch.rand(num_tokens, 1, generator=gen) < 0.8)
    elif kind == "one":
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        scores[:, 0] = 10.0
    elif kind == "empty":
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        scores[:, -1] = -1.0
    else:
        raise ValueError(kind)
    return torch.topk(scores, topk, dim=1).indices


def random_problem(num_tokens, hidden, ffn, num_experts, topk, *, dtype=torch.float64, gen=None,
                   kind="uniform"):  # fmt: skip
    x = torch.randn(num_tokens, hidden, generator=gen, dtype=dtype)
    w13 = torch.randn(num_experts, 2 * ffn, hidden, generator=gen, dtype=dtype) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, ffn, generator=gen, dtype=dtype) / ffn**0.5
    idx = random_routing(num_tokens, num_experts, topk, gen=gen, kind=kind)
    probs = torch.rand(num_tokens, topk, generator=gen, dtype=dtype)
    return x, w13, w2, idx, probs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def free_port() -> int:
    """A free TCP port on localhost for a spawned process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned(target, args_of_rank, world: int, timeout: float) -> tuple[list[int], list]:
    """Start ``target(*args_of_rank(r))`` for every rank in spawned processes under one deadline
    for the whole world; kill what is still alive then. Returns (ranks that hung, exit codes)."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of_rank(r)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return hung, [p.exitcode for p in procs]
