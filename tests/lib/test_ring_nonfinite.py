"""Non-finite inputs (issue #17 item 4): NaN or Inf in x, the router probabilities or an expert's
weights reaches exactly the outputs and gradients the float64 oracle says it reaches, on every
rank, in both ring modes and the all-to-all mode; nothing hangs and the group stays in step
(a clean call afterwards is oracle-exact).

World 2 over gloo, both hop backends (torch in float64 with every poison in every mode, the
Triton kernels under the interpreter in float32 with a poison of x, of the probabilities and of
a weight in each mode: ``PLAN``). A poisoned entry sits on one rank's tokens or experts; the
other rank's results are affected only through the tokens routed to a poisoned expert, as the
oracle's are.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.options import RingConfig
from tests.fixtures import oracle, ring_problem

pytestmark = pytest.mark.slow

WORLD, TOKENS, H, I, EL, K = 2, (5, 4), 12, 6, 2, 2
# (what, where): the poisoned input and its entry; "expert" entries are global expert ids
POISONS = [
    ("x", (1, 3), float("nan")),  # rank 0's token 1
    ("x", (6, 0), float("inf")),  # rank 1's token 1 (global row 6)
    ("probs", (2, 1), float("inf")),
    ("probs", (7, 0), float("nan")),
    ("w13", (3, 2, 5), float("nan")),  # expert 3, owned by rank 1
    ("w2", (0, 4, 1), float("-inf")),  # expert 0, owned by rank 0
]
MODES = ("expert", "token", "alltoall")
# The poisons each mode gets per backend (indices into POISONS). The torch hops (float64, cheap)
# get every poison in every mode. The Triton kernels (the interpreter: seconds a call) get, in
# each mode, one poison of x, one of the router probabilities and one of an expert weight, every
# poison in at least one mode: each (kernel, kind of input poisoned) pair and each mode's
# buffers (travelling weights, travelling tokens and trailing outputs, the all-to-all's
# dispatch) still meets a NaN or an Inf.
ALL = tuple(range(len(POISONS)))
PLAN = {
    "torch": {mode: ALL for mode in MODES},
    "triton": {"expert": (0, 3, 4), "token": (1, 2, 5), "alltoall": (1, 3, 5)},
}


def _problem(seed: int):
    return ring_problem(seed, TOKENS, EL * WORLD, K, H, I)


def _compare(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> str | None:
    """None when ``got`` is non-finite exactly where ``ref`` is and close elsewhere."""
    got, ref = got.detach().double(), ref.double()
    fin_got, fin_ref = torch.isfinite(got), torch.isfinite(ref)
    if not torch.equal(fin_got, fin_ref):
        where = (fin_got != fin_ref).nonzero()[:4].tolist()
        return f"{name}: non-finite pattern differs from the oracle's at {where}"
    a, b = got[fin_ref], ref[fin_ref]
    if b.numel() and (a - b).norm() > tol * max(b.norm().item(), 1e-30):
        return f"{name}: finite entries off by {((a - b).norm() / b.norm()).item():.2e}"
    return None


def _slices(rank):
    """This rank's tokens (rows) and experts of the global problem."""
    return slice(sum(TOKENS[:rank]), sum(TOKENS[: rank + 1])), slice(rank * EL, (rank + 1) * EL)


def _run(rank, group, pb, mode, backend, dtype):
    from relaymoe.ring import ring_moe

    rows, experts = _slices(rank)
    x = pb["x"][rows].to(dtype).requires_grad_()
    w13 = pb["w13"][experts].to(dtype).requires_grad_()
    w2 = pb["w2"][experts].to(dtype).requires_grad_()
    probs = pb["probs"][rows].to(dtype).requires_grad_()
    out = ring_moe(x, w13, w2, pb["idx"][rows], probs, group=group, backend=backend,
                   config=RingConfig(mode=mode))  # fmt: skip
    out.backward(pb["dy"][rows].to(dtype))
    return {"out": out, "dx": x.grad, "dprobs": probs.grad, "dw13": w13.grad, "dw2": w2.grad}


def _check(rank, group, pb, mode, backend, dtype, tol, what):
    ref = oracle(pb)
    got = _run(rank, group, pb, mode, backend, dtype)
    rows, experts = _slices(rank)
    errors = [_compare(k, got[k], ref[k][experts if k in ("dw13", "dw2") else rows], tol)
              for k in got]  # fmt: skip
    return [f"{what} rank {rank}: {e}" for e in errors if e]


def poisoned_calls_then_a_clean_one(rank, world, group):
    failures, reached, cases = [], 0, 0
    for backend, dtype, tol in (("torch", torch.float64, 1e-11), ("triton", torch.float32, 1e-4)):
        for mode in MODES:
            for p in PLAN[backend][mode]:
                name, at, value = POISONS[p]
                cases += 1
                pb = _problem(100 + p)
                pb[name][at] = value
                ref_out = oracle(pb)["out"]
                # the oracle itself must show the poison somewhere and leave finite entries
                assert not torch.isfinite(ref_out).all() and torch.isfinite(ref_out).any()
                reached += int(not torch.isfinite(ref_out).all())
                what = f"{backend} {mode} {name}{list(at)}={value}"
                failures += _check(rank, group, pb, mode, backend, dtype, tol, what)
            # the group is still in step: a clean call agrees with the oracle
            what = f"{backend} {mode} clean call after the poisoned ones"
            failures += _check(rank, group, _problem(7), mode, backend, dtype, tol, what)
    assert not failures, "\n".join(failures)
    assert reached == cases == len(MODES) * len(POISONS) + 3 * len(MODES)


def test_nonfinite_inputs_propagate_like_the_oracle_and_never_hang(gloo_worlds):
    # the Triton plan: every poison somewhere, every mode a poison of each kind of input
    triton = PLAN["triton"]
    assert sorted({p for ps in triton.values() for p in ps}) == list(ALL), triton
    for mode in MODES:
        kinds = sorted(POISONS[p][0].rstrip("132") for p in triton[mode])
        assert kinds == ["probs", "w", "x"], (mode, kinds)
    # a hang or a dead rank here: a non-finite input desynchronised the group
    gloo_worlds.run(poisoned_calls_then_a_clean_one, WORLD, timeout=240, pg_timeout_s=60)
