"""The ring's weight-gradient accumulators (``RingConfig.grad_accum``, options.GRAD_ACCUMS).

Over spawned gloo worlds: with 16-bit weights, ``fp32`` accumulators (the travelling gradients
of expert mode, the local sums of token mode) bring the ring's weight-gradient error back to the
all-to-all's, where ``param`` accumulators add one rounding per hop; the gradients come back in
the weights' dtype; ``auto`` resolves by EP; ranks that ask differently all raise; fp32 weights
give bitwise the same results either way. The cost model's side is in test_cost.py.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.options import RingConfig
from tests.fixtures import oracle, rel_err, ring_problem, scenario_params

pytestmark = pytest.mark.slow

H, I, EL, K, T = 64, 32, 4, 4, 96


def _grads(rank, world, group, pb, mode, grad_accum, dtype):
    from relaymoe.ring import ring_moe

    rows, experts = slice(rank * T, (rank + 1) * T), slice(rank * EL, (rank + 1) * EL)
    x = pb["x"][rows].to(dtype).requires_grad_()
    w13 = pb["w13"][experts].to(dtype).requires_grad_()
    w2 = pb["w2"][experts].to(dtype).requires_grad_()
    probs = pb["probs"][rows].float().requires_grad_()
    config = RingConfig(mode=mode, grad_accum=grad_accum)
    out = ring_moe(x, w13, w2, pb["idx"][rows], probs, group=group, backend="torch",
                   config=config)  # fmt: skip
    out.backward(pb["dy"][rows].to(dtype))
    assert w13.grad.dtype == dtype and w2.grad.dtype == dtype  # back in the weights' dtype
    return {"dw13": w13.grad.detach().clone(), "dw2": w2.grad.detach().clone()}


def _gathered(group, world, t):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def _fp32_accumulators_remove_the_per_hop_rounding(rank, world, group):
    """bf16 weights at EP 4: the ring's dw error over the all-to-all's, per accumulator dtype,
    summed over three problems (the all-to-all computes each gradient in one GEMM)."""
    err = {}
    for seed in (1, 2, 3):
        pb = ring_problem(seed, [T] * world, EL * world, K, H, I)
        # the oracle of the inputs as the ranks hold them: bf16 but for the fp32 probabilities
        ref = oracle({k: v.to(torch.bfloat16).double() if k in ("x", "w13", "w2", "dy") else v
                      for k, v in pb.items()})  # fmt: skip
        for mode, acc in (("alltoall", "param"), ("expert", "param"), ("expert", "fp32"),
                          ("token", "param"), ("token", "fp32")):  # fmt: skip
            got = _grads(rank, world, group, pb, mode, acc, torch.bfloat16)
            for name in ("dw13", "dw2"):
                e = rel_err(_gathered(group, world, got[name]), ref[name])
                err[(mode, acc, name)] = err.get((mode, acc, name), 0.0) + e
    for mode in ("expert", "token"):
        for name in ("dw13", "dw2"):
            base = err[("alltoall", "param", name)]
            fp32, param = err[(mode, "fp32", name)] / base, err[(mode, "param", name)] / base
            assert fp32 < 1.1, (mode, name, fp32)  # no growth with the hops
            assert param > 1.15, (mode, name, param)  # what the per-hop rounding costs at EP 4


def _resolution_and_refusals(rank, world, group):
    from relaymoe.ring import resolved_problem

    pb = ring_problem(7, [T] * world, EL * world, K, H, I)
    rows, experts = slice(rank * T, (rank + 1) * T), slice(rank * EL, (rank + 1) * EL)
    args = [pb["x"][rows].bfloat16(), pb["w13"][experts].bfloat16(),
            pb["w2"][experts].bfloat16(), pb["idx"][rows], pb["probs"][rows].float()]  # fmt: skip
    for acc, want in (("param", torch.bfloat16), ("fp32", torch.float32),
                      ("auto", torch.bfloat16)):  # auto: fp32 from 16 ranks  # fmt: skip
        config = RingConfig(mode="expert", grad_accum=acc)
        problem = resolved_problem(*args, group=group, config=config)
        assert problem.accum_dtype == want, (acc, problem.accum_dtype)
    with pytest.raises(ValueError, match="RingConfig.grad_accum='fp16' is not one of"):
        RingConfig(grad_accum="fp16")  # refused where it is made, before any call
    mine = RingConfig(grad_accum="fp32" if rank == 0 else "param")
    with pytest.raises(ValueError, match="grad_accum .* differs across ranks"):
        resolved_problem(*args, group=group, config=mine)
    # fp32 weights: the accumulators are fp32 either way, the results bitwise equal
    a = _grads(rank, world, group, pb, "expert", "param", torch.float32)
    b = _grads(rank, world, group, pb, "expert", "fp32", torch.float32)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the biases' gradients trail home in the same accumulators as the weights': fp32 sums
    # of bf16 biases, returned in bf16, within bf16 rounding of the oracle
    _biased_bf16(rank, world, group, "expert")


def _biased_problem(seed, world):
    """A ``ring_problem`` with fc1/fc2 biases (GeGLU, float64) and its oracle on the bf16
    rounding of what the ranks hold."""
    from relaymoe.reference import moe_experts_reference

    pb = ring_problem(seed, [T] * world, EL * world, K, H, I)
    g = torch.Generator().manual_seed(seed)
    pb["b13"] = 0.5 * torch.randn(EL * world, 2 * I, generator=g, dtype=torch.float64)
    pb["b2"] = 0.5 * torch.randn(EL * world, H, generator=g, dtype=torch.float64)
    leaves = {k: pb[k].to(torch.bfloat16).double().requires_grad_()
              for k in ("x", "w13", "w2", "b13", "b2")}  # fmt: skip
    out = moe_experts_reference(leaves["x"], leaves["w13"], leaves["w2"], pb["idx"],
                                pb["probs"], activation="geglu", b13=leaves["b13"],
                                b2=leaves["b2"])  # fmt: skip
    out.backward(pb["dy"].to(torch.bfloat16).double())
    return pb, {k: v.grad for k, v in leaves.items()}


def _biased_bf16(rank, world, group, mode, listed=False):
    from relaymoe.ring import ring_moe

    pb, ref = _biased_problem(5, world)
    rows, experts = slice(rank * T, (rank + 1) * T), slice(rank * EL, (rank + 1) * EL)
    ws = {k: pb[k][experts].bfloat16().requires_grad_() for k in ("w13", "w2", "b13", "b2")}
    if listed:
        ws = {k: [w.detach().requires_grad_() for w in v] for k, v in ws.items()}
    out = ring_moe(pb["x"][rows].bfloat16(), ws["w13"], ws["w2"], pb["idx"][rows],
                   pb["probs"][rows].float(), group=group, backend="torch",
                   activation="geglu", b13=ws["b13"], b2=ws["b2"],
                   config=RingConfig(mode=mode, grad_accum="fp32"))  # fmt: skip
    out.backward(pb["dy"][rows].bfloat16())
    for k, w in ws.items():
        grad = torch.stack([e.grad for e in w]) if listed else w.grad
        assert grad.dtype == torch.bfloat16, (k, grad.dtype)
        assert rel_err(grad, ref[k][experts]) < 1e-2, (mode, k, rel_err(grad, ref[k][experts]))


SCENARIOS = (_fp32_accumulators_remove_the_per_hop_rounding, _resolution_and_refusals)


@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS, [4]))
def test_ring_grad_accum_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=400)


@pytest.mark.parametrize("mode", ["expert", "token"])
def test_world_of_one_and_list_form_with_fp32_accumulators(mode):
    """No process group (a world of one) and per-expert weight lists: fp32 accumulators give
    gradients in the weights' dtype, per expert, within bf16 rounding of the oracle."""
    from relaymoe.ring import ring_moe

    pb = ring_problem(11, [T], EL, K, H, I)
    ref = oracle({k: v.to(torch.bfloat16).double() if k in ("x", "w13", "w2", "dy") else v
                  for k, v in pb.items()})  # fmt: skip
    w13 = [w.bfloat16().requires_grad_() for w in pb["w13"]]
    w2 = [w.bfloat16().requires_grad_() for w in pb["w2"]]
    x = pb["x"].bfloat16().requires_grad_()
    out = ring_moe(x, w13, w2, pb["idx"], pb["probs"].float(), backend="torch",
                   config=RingConfig(mode=mode, grad_accum="fp32"))  # fmt: skip
    out.backward(pb["dy"].bfloat16())
    assert all(w.grad.dtype == torch.bfloat16 for w in (*w13, *w2))
    assert rel_err(torch.stack([w.grad for w in w13]), ref["dw13"]) < 1e-2
    assert rel_err(torch.stack([w.grad for w in w2]), ref["dw2"]) < 1e-2
    _biased_bf16(0, 1, None, mode, listed=True)  # with biases: theirs too
