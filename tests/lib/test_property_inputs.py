"""Property tests of the public API's input contract (issue #32): random strides (contiguous,
transposed, sliced, expanded), dtypes (every float dtype, integer ones, bool, complex), shapes
(T in {0, 1, odd}, odd H and I, K in {1, E}, empty experts), ``out=`` present or absent, weights
as tensors or per-expert lists. Each case matches the float64 oracle within its dtype's bound,
gradients included, or raises a ``ValueError`` from relaymoe; which one is decided from the
case before the call (``tests/lib/property_inputs.py``), so a refusal of a valid case fails too.

Seeded and deterministic. The ring and the tensor-parallel loss run many cases inside one
spawned gloo world per world size (a spawn costs seconds; a case milliseconds); the ring's
Triton hops run in the world of one (the interpreter is slow), their multi-rank paths in
``test_ring_dist.py``. bf16 runs on
the torch backend here (the Triton interpreter's bf16 is wrong); its Triton twin is
``tests/gpu/test_property_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import scenario_params
from tests.lib import property_inputs as P

CPU_TRITON_DTYPES = (torch.float16, torch.float32, torch.float64)  # no bf16 in the interpreter


def _enough(tally, n: int) -> None:
    """The draw covers both outcomes: most cases valid, some refused."""
    assert tally["valid"] >= n // 2 and tally["refused"] >= n // 20, tally


def test_moe_experts_torch_backend():
    n = 200
    tally = P.tally_cases(P.run_moe_case, P.moe_cases(n, seed=1))
    _enough(tally, n)


def test_moe_experts_triton_backend():
    from relaymoe.kernels import interpret_mode, triton_available

    if not (triton_available() and interpret_mode()):
        pytest.skip("the Triton backend runs on CPU under TRITON_INTERPRET=1")
    n = 24
    cases = P.moe_cases(n, seed=2, backends=("triton",), dtypes=CPU_TRITON_DTYPES)
    tally = P.tally_cases(P.run_moe_case, cases)
    assert tally["valid"] >= n // 4 and tally["refused"] >= 1, tally


def test_linear_cross_entropy():
    n = 120
    cases = P.loss_cases(n, seed=3)
    cases += P.loss_cases(16, seed=4, impls=("triton",), dtypes=CPU_TRITON_DTYPES)
    tally = P.tally_cases(P.run_loss_case, cases)
    _enough(tally, len(cases))


def test_ring_moe_world_of_one():
    n = 30
    tally = P.tally_cases(
        lambda c: P.run_ring_case(c, 0, 1, None), P.ring_cases(n, seed=5, world=1)
    )
    _enough(tally, n)
    from relaymoe.kernels import interpret_mode, triton_available

    if triton_available() and interpret_mode():  # the hops' Triton kernels inside the ring
        cases = P.ring_cases(3, seed=7, world=1, backends=("triton",), dtypes=(torch.float32,))
        assert P.tally_cases(lambda c: P.run_ring_case(c, 0, 1, None), cases)["valid"] >= 1


RING_CASES = {2: 24, 3: 16}
TP_CASES = {2: 16, 3: 12}


def _ring_world(rank, world, group):
    """Every ring case of this world size on this rank (all ranks run the same cases)."""
    cases = P.ring_cases(RING_CASES[world], seed=6, world=world)
    tally = P.tally_cases(lambda c: P.run_ring_case(c, rank, world, group), cases)
    assert tally["valid"] >= len(cases) // 2, tally


def _loss_world(rank, world, group):
    cases = P.tp_loss_cases(TP_CASES[world], seed=8, world=world)
    tally = P.tally_cases(lambda cb: P.run_tp_loss_case(*cb, rank, world, group), cases)
    assert tally["valid"] >= 1 and tally["refused"] >= 1, tally


@pytest.mark.parametrize(("world", "scenario"), scenario_params([_ring_world, _loss_world], [2, 3]))
def test_ring_moe_and_tensor_parallel_loss_gloo(world, scenario, gloo_worlds):
    gloo_worlds.run(scenario, world, timeout=240)


def test_tally_cases_reports_every_broken_case():
    """One broken case does not hide the next: all are run, the count and the first ones named."""

    def run(case):
        assert case % 3, f"case {case} broke"
        return "valid" if case % 2 else "refused"

    assert P.tally_cases(run, [1, 2, 4, 5]) == {"valid": 2, "refused": 2}
    with pytest.raises(AssertionError) as info:
        P.tally_cases(run, range(1, 10), shown=1)
    msg = str(info.value)
    assert "3 of 9 cases broke the rule" in msg and "case 3 broke" in msg
    assert "case 6 broke" not in msg  # shown=1
