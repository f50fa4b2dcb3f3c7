"""``ring_moe(..., fp8=state)`` over gloo worlds on the Triton interpreter (fp32 and fp16
inputs): the fp8 ring against ``moe_experts(fp8=...)`` over all experts, its weight cache, and
the bytes of expert weights each rank sends (``RingRuntime.weight_bytes_sent``): the fp8
copies and their scales, half the 16-bit ring's bytes plus the scales.

Blockwise scales do not depend on which experts a hop holds (1x128 tiles of each row, 128x128
weight blocks), so at any EP the ring computes what one ``moe_experts`` call over every expert
computes, up to the order of fp32 sums (``SUM``). The tensor-scaled recipes scale each hop's
intermediates over the hop's range (``fp8_experts.py``): tested against the unquantised ring
within fp8's error (``FP8``).
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.kernels import interpret_mode
from relaymoe.options import KernelOptions, RingConfig
from tests.fixtures import rel_err, ring_problem, scenario_params

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not interpret_mode(), reason="the fp8 kernels run under TRITON_INTERPRET=1"),
]

SUM = 1e-5  # the same fp8 operands, fp32 sums in another order
FP8 = 0.1  # e4m3 operands (3 mantissa bits) against the unquantised layer
EL, K, T = 1, 2, 12
CONFIG = RingConfig(mode="expert", kernels=KernelOptions(wgrad="gmm"))  # bf16 wgrads: torch's


def _slices(rank):
    return slice(rank * T, (rank + 1) * T), slice(rank * EL, (rank + 1) * EL)


def _ring(rank, group, pb, dtype, fp8, runtime, *, listed=False, backend="triton"):
    """Output and gradients of this rank's share of ``pb``; the weights as leaves (lists with
    ``listed``, as Megatron's experts)."""
    from relaymoe.ring import ring_moe

    rows, experts = _slices(rank)
    x = pb["x"][rows].to(dtype).requires_grad_()
    probs = pb["probs"][rows].float().requires_grad_()
    ws = [pb[k][experts].to(dtype) for k in ("w13", "w2")]
    ws = [[e.clone().requires_grad_() for e in w] if listed else w.requires_grad_() for w in ws]
    out = ring_moe(x, *ws, pb["idx"][rows], probs, group=group, backend=backend, config=CONFIG,
                   runtime=runtime, fp8=fp8)  # fmt: skip
    out.backward(pb["dy"][rows].to(dtype))
    dw = [torch.stack([e.grad for e in w]) if listed else w.grad for w in ws]
    return {"out": out.detach(), "dx": x.grad, "dprobs": probs.grad, "dw13": dw[0],
            "dw2": dw[1]}  # fmt: skip


def _whole(pb, world, recipe):
    """``moe_experts(fp8=recipe)`` over every token and expert: what the ring must give."""
    from relaymoe.experts import moe_experts

    leaves = {k: pb[k].float().requires_grad_() for k in ("x", "w13", "w2", "probs")}
    out = moe_experts(leaves["x"], leaves["w13"], leaves["w2"], pb["idx"], leaves["probs"],
                      fp8=recipe, kernels=CONFIG.kernels)  # fmt: skip
    out.backward(pb["dy"].float())
    return {"out": out.detach(), "dx": leaves["x"].grad, "dprobs": leaves["probs"].grad,
            "dw13": leaves["w13"].grad, "dw2": leaves["w2"].grad}  # fmt: skip


def _blockwise_ring_is_one_call_over_all_experts(rank, world, group):
    from relaymoe import Fp8State
    from relaymoe.ring import RingRuntime

    pb = ring_problem(3, [T] * world, EL * world, K, 128, 128)
    want = _whole(pb, world, "blockwise")
    state, runtime = Fp8State("blockwise"), RingRuntime(group)
    got = _ring(rank, group, pb, torch.float32, state, runtime, listed=True)
    rows, experts = _slices(rank)
    for name in ("out", "dx", "dprobs"):
        assert rel_err(got[name], want[name][rows]) < SUM, name
    for name in ("dw13", "dw2"):
        assert rel_err(got[name], want[name][experts]) < SUM, name
    assert state.quantizations == 1


def _fp8_sends_half_the_16bit_bytes(rank, world, group):
    """fp16 weights (bf16's size; the interpreter computes fp16 exactly): one forward and
    backward, the 16-bit ring against the fp8 ring, bytes of weights this rank sent."""
    from relaymoe import Fp8State
    from relaymoe.ring import RingRuntime
    from relaymoe.ring.plan import ALIGN

    H, I = 64, 32
    pb = ring_problem(4, [T] * world, EL * world, K, H, I)
    r16, r8 = RingRuntime(group), RingRuntime(group)
    ref = _ring(rank, group, pb, torch.float32, None, RingRuntime(group), backend="torch")
    _ring(rank, group, pb, torch.float16, None, r16, backend="torch")
    state = Fp8State("tensorwise")
    got = _ring(rank, group, pb, torch.float16, state, r8)
    weights = EL * (2 * I * H + H * I)  # elements of this rank's experts
    passes = 2 * (world - 1)  # forward and backward each forward R-1 partitions
    assert r16.weight_bytes_sent == passes * 2 * weights
    scales = 4 * 2 * EL  # one fp32 inverse scale per expert and weight (tensorwise)
    per_pass = r8.weight_bytes_sent // passes
    assert r8.weight_bytes_sent == passes * per_pass
    assert weights + scales <= per_pass < weights + scales + 3 * ALIGN, (per_pass, weights)
    if rank == 0:
        sent = (r16.weight_bytes_sent, r8.weight_bytes_sent)
        print(f"EP {world}: weight bytes sent per step, 16-bit {sent[0]}, fp8 {sent[1]}")
    for name in ("out", "dx", "dw13", "dw2"):  # e4m3 and e5m2 operands, fp16 results
        assert rel_err(got[name], ref[name]) < FP8, (name, rel_err(got[name], ref[name]))
    # the weights' fp8 copy is the state's until they change: an in-place update re-quantises
    again = _ring(rank, group, pb, torch.float16, state, r8)
    assert state.quantizations == 2  # two sets of leaves made above: a fresh copy each
    assert torch.equal(again["out"], got["out"])


def _delayed_histories_agree_and_round_trip(rank, world, group):
    """Delayed scaling over the ring: one history entry per role and pass (not per hop), each
    rank's histories differ (its own tokens), agree on
    their maximum after ``agree_histories``, and a checkpoint of them (the layer's
    ``_extra_state``, ``megatron/fp8_checkpoint.py``) gives a fresh state the same scales."""
    import torch.distributed as dist

    from relaymoe import Fp8Recipe, Fp8State
    from relaymoe.megatron.fp8_checkpoint import Fp8ExtraState
    from relaymoe.ring import RingRuntime

    pb = ring_problem(5 + rank, [T] * world, EL * world, K, 64, 32)  # other tokens per rank
    recipe = Fp8Recipe("delayed", amax_history_len=4)
    state = Fp8State(recipe)
    for _ in range(2):
        _ring(rank, group, pb, torch.float32, state, RingRuntime(group))
    roles = state.roles()
    mine = torch.stack([state.scales.history[r] for r in roles])
    # one entry per role and call (forward or backward), not one per hop
    assert (mine[:, :2] > 0).all() and (mine[:, 2:] == 0).all(), mine
    state.agree_histories(group, torch.device("cpu"))
    merged = torch.stack([state.scales.history[r] for r in roles])
    everyone = [torch.empty_like(merged) for _ in range(world)]
    dist.all_gather(everyone, merged, group=group)
    assert all(torch.equal(e, everyone[0]) for e in everyone)
    assert torch.equal(merged, torch.maximum(mine, merged)) and (merged[:, :2] > 0).all()
    saved = Fp8ExtraState(state).state_dict()
    assert set(saved) == {"_extra_state"}
    fresh = Fp8State(recipe)
    Fp8ExtraState(fresh).load_state_dict(saved)
    for r in roles:
        assert torch.equal(fresh.scales.scales[r], state.scales.scales[r]), r
    with pytest.raises(ValueError, match="resume with the saving run's --fp8-recipe"):
        Fp8State("tensorwise").load_state_dict(saved["_extra_state"])


SCENARIOS = (_blockwise_ring_is_one_call_over_all_experts, _fp8_sends_half_the_16bit_bytes)


@pytest.mark.parametrize(
    ("world", "scenario"),
    scenario_params(SCENARIOS, [2, 4])
    + scenario_params([_delayed_histories_agree_and_round_trip], [2]),
)
def test_ring_fp8_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=400)
