"""CPU demo run by scripts/run_example.sh on a machine without a GPU.

Builds the routing index of a Qwen3-30B-A3B-sized routing (E=128 experts, top-8) with both
builds, checks they agree, and runs relaymoe's expert computation against the oracle on a
Qwen3-shaped layer scaled down to CPU size. Prints timings.
"""

from __future__ import annotations

import time

import torch

from relaymoe.experts import moe_experts
from relaymoe.reference import moe_experts_reference
from relaymoe.routing import build_routing_index


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def main() -> None:
    torch.manual_seed(0)
    tokens, experts, topk = 32768, 128, 8
    idx = torch.topk(torch.rand(tokens, experts), topk, dim=1).indices
    index, ms = _timed(lambda: build_routing_index(idx, experts, impl="torch"))
    print(f"routing index (torch build)  T={tokens} E={experts} K={topk}: {ms:8.1f} ms")
    try:
        tri, ms_t = _timed(lambda: build_routing_index(idx[:2048], experts, impl="triton"))
        ref = build_routing_index(idx[:2048], experts, impl="torch")
        same = all(
            torch.equal(getattr(tri, f), getattr(ref, f))
            for f in ("expert_token_indices", "expert_token_offsets", "token_index_map")
        )
        print(f"routing index (Triton interpreter) T=2048: {ms_t:8.1f} ms, equal to torch: {same}")
    except Exception as exc:  # the Triton build needs TRITON_INTERPRET=1 on CPU
        print(f"routing index (Triton): skipped on CPU ({type(exc).__name__}: {exc})")

    # Qwen3-30B-A3B layer shape (H=2048, I=768, E=128, K=8) with fewer tokens for a CPU.
    t, h, i = 512, 2048, 768
    x = torch.randn(t, h)
    w13 = torch.randn(experts, 2 * i, h) / h**0.5
    w2 = torch.randn(experts, h, i) / i**0.5
    idx = torch.topk(torch.rand(t, experts), topk, dim=1).indices
    probs = torch.softmax(torch.randn(t, topk), dim=1)
    y, ms = _timed(lambda: moe_experts(x, w13, w2, idx, probs, backend="torch"))
    y_ref = moe_experts_reference(x.double(), w13.double(), w2.double(), idx, probs.double())
    err = ((y.double() - y_ref).norm() / y_ref.norm()).item()
    shape = f"T={t} H={h} I={i} E={experts} K={topk}"
    print(f"moe_experts fp32 {shape}: {ms:8.1f} ms, rel err {err:.2e}")


if __name__ == "__main__":
    main()
