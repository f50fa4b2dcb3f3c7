"""``ring_moe(..., fp8=state)`` on Hopper GPUs, bf16 inputs.

One GPU: the ring's world of one against ``moe_experts(fp8=...)`` per recipe (the same kernels
on the same quantised operands; the ring recomputes h in its backward where ``moe_experts``
saves it). Two GPUs (NCCL, both transports): blockwise at EP 2 against one ``moe_experts`` call
over every expert and token (blockwise scales do not depend on the hop's experts; the ring adds
its hops' bf16 outputs in another order: ``HOPS``), and the expert-weight bytes each rank sends
per step: the fp8 copies and their scales against the bf16 ring's (``weight_bytes_sent``).
Skipped without an sm90 GPU (two for the second test).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.fixtures import rel_err, ring_problem, run_scenarios, sm90_gpu_marks

pytestmark = sm90_gpu_marks()

SAME = 5e-3  # the same fp8 GEMMs; bf16 outputs (h recomputed in the ring's backward)
HOPS = 1e-2  # bf16 partial outputs of two hops added in another order than one call's
H, I, EL, K, T = 1024, 512, 4, 4, 1536
BF16 = torch.bfloat16


def _run(fn, x, w13, w2, idx, probs, dy):
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, probs)]
    out = fn(leaves[0], leaves[1], leaves[2], idx, leaves[3])
    out.backward(dy)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed"])
def test_ring_of_one_is_moe_experts_fp8(recipe):
    from relaymoe import Fp8State
    from relaymoe.experts import moe_experts
    from relaymoe.ring import RingRuntime, ring_moe

    pb = ring_problem(1, [T], EL * 4, K, H, I)
    args = [pb[k].to("cuda", BF16) for k in ("x", "w13", "w2")] + [pb["idx"].cuda()]
    args += [pb["probs"].cuda().float(), pb["dy"].to("cuda", BF16)]
    ring_state, ref_state, rt = Fp8State(recipe), Fp8State(recipe), RingRuntime()
    for _ in range(2):  # delayed: the second call scales from the first's history
        got = _run(lambda *a: ring_moe(*a, fp8=ring_state, runtime=rt), *args)
        want = _run(lambda *a: moe_experts(*a, fp8=ref_state), *args)
        for name, a, b in zip(("out", "dx", "dw13", "dw2", "dprobs"), got, want, strict=True):
            assert rel_err(a, b) < SAME, (recipe, name, rel_err(a, b))
    assert rt.weight_bytes_sent == 0  # a world of one sends nothing


def _ep2(rank, world, group):
    from relaymoe import Fp8State
    from relaymoe.experts import moe_experts
    from relaymoe.options import RingConfig
    from relaymoe.ring import RingRuntime, ring_moe
    from relaymoe.ring.plan import ALIGN

    dev = torch.device("cuda", rank)
    pb = ring_problem(2, [T] * world, EL * world, K, 1024, 512)
    rows, experts = slice(rank * T, (rank + 1) * T), slice(rank * EL, (rank + 1) * EL)
    whole = [pb[k].to(dev, BF16) for k in ("x", "w13", "w2")] + [pb["idx"].to(dev)]
    whole += [pb["probs"].to(dev).float(), pb["dy"].to(dev, BF16)]
    want = _run(lambda *a: moe_experts(*a, fp8="blockwise"), *whole)
    mine = [whole[0][rows], whole[1][experts], whole[2][experts], whole[3][rows], whole[4][rows],
            whole[5][rows]]  # fmt: skip
    for transport in ("nccl", "copy_engine"):
        config = RingConfig(mode="expert", transport=transport)
        rt8, rt16 = RingRuntime(group), RingRuntime(group)
        got = _run(partial(ring_moe, group=group, config=config, runtime=rt8,
                           fp8=Fp8State("blockwise")), *mine)  # fmt: skip
        _run(partial(ring_moe, group=group, config=config, runtime=rt16), *mine)
        for name, a, b, sl in zip(("out", "dx", "dw13", "dw2", "dprobs"), got, want,
                                  (rows, rows, experts, experts, rows), strict=True):  # fmt: skip
            assert rel_err(a, b[sl]) < HOPS, (transport, name, rel_err(a, b[sl]))
        weights = EL * (2 * I * H + H * I)
        scales = 4 * EL * ((2 * I // 128) * (H // 128) + (H // 128) * (I // 128))
        passes = 2 * (world - 1)
        assert rt16.weight_bytes_sent == passes * 2 * weights
        assert passes * (weights + scales) <= rt8.weight_bytes_sent
        assert rt8.weight_bytes_sent < passes * (weights + scales + 3 * ALIGN)
        if rank == 0:
            print(f"{transport}: weight bytes sent per step at EP 2, bf16 "
                  f"{rt16.weight_bytes_sent}, fp8 {rt8.weight_bytes_sent}")  # fmt: skip


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_ring_fp8_two_gpus():
    run_scenarios([_ep2], 2, timeout=300, pg_timeout_s=60, backend="nccl")
