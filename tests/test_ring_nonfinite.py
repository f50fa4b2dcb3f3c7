"""Non-finite inputs (issue #17 item 4): NaN or Inf in x, the router probabilities or an expert's
weights reaches exactly the outputs and gradients the float64 oracle says it reaches, on every
rank, in both ring modes and the all-to-all mode; nothing hangs and the group stays in step
(a clean call afterwards is oracle-exact).

World 2 over gloo, both hop backends (torch in float64, the Triton kernels under the interpreter
in float32). A poisoned entry sits on one rank's tokens or experts; the other rank's results are
affected only through the tokens routed to a poisoned expert, as the oracle's are.
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from relaymoe.reference import moe_experts_reference
from tests.helpers import free_port, run_spawned

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


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    total, E = sum(TOKENS), EL * WORLD
    f64 = torch.float64
    idx = torch.rand(total, E, generator=g).argsort(1)[:, :K]
    return dict(
        x=torch.randn(total, H, generator=g, dtype=f64),
        w13=torch.randn(E, 2 * I, H, generator=g, dtype=f64) / H**0.5,
        w2=torch.randn(E, H, I, generator=g, dtype=f64) / I**0.5,
        idx=idx,
        probs=torch.rand(total, K, generator=g, dtype=f64) + 0.1,
        dy=torch.randn(total, H, generator=g, dtype=f64),
    )


def _oracle(pb):
    leaves = {k: pb[k].clone().requires_grad_() for k in ("x", "w13", "w2", "probs")}
    out = moe_experts_reference(
        leaves["x"], leaves["w13"], leaves["w2"], pb["idx"], leaves["probs"]
    )
    out.backward(pb["dy"])
    return out.detach(), {k: v.grad for k, v in leaves.items()}


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


def _run(rank, group, pb, mode, backend, dtype):
    from relaymoe.ring import ring_moe

    lo, hi = sum(TOKENS[:rank]), sum(TOKENS[: rank + 1])
    e0, e1 = rank * EL, (rank + 1) * EL
    x = pb["x"][lo:hi].to(dtype).requires_grad_()
    w13 = pb["w13"][e0:e1].to(dtype).requires_grad_()
    w2 = pb["w2"][e0:e1].to(dtype).requires_grad_()
    probs = pb["probs"][lo:hi].to(dtype).requires_grad_()
    out = ring_moe(x, w13, w2, pb["idx"][lo:hi], probs, group=group, mode=mode, backend=backend)
    out.backward(pb["dy"][lo:hi].to(dtype))
    return {"out": out, "x": x.grad, "probs": probs.grad, "w13": w13.grad, "w2": w2.grad}


def _check(rank, group, pb, mode, backend, dtype, tol, what):
    ref_out, ref_g = _oracle(pb)
    got = _run(rank, group, pb, mode, backend, dtype)
    lo, hi = sum(TOKENS[:rank]), sum(TOKENS[: rank + 1])
    e0, e1 = rank * EL, (rank + 1) * EL
    refs = {"out": ref_out[lo:hi], "x": ref_g["x"][lo:hi], "probs": ref_g["probs"][lo:hi],
            "w13": ref_g["w13"][e0:e1], "w2": ref_g["w2"][e0:e1]}  # fmt: skip
    errors = [_compare(k, got[k], refs[k], tol) for k in refs]
    return [f"{what} rank {rank}: {e}" for e in errors if e]


def _scenarios(rank, group):
    failures, reached = [], 0
    for backend, dtype, tol in (("torch", torch.float64, 1e-11), ("triton", torch.float32, 1e-4)):
        for mode in MODES:
            for p, (name, at, value) in enumerate(POISONS):
                pb = _problem(100 + p)
                pb[name][at] = value
                ref_out, ref_g = _oracle(pb)
                # the oracle itself must show the poison somewhere and leave finite entries
                assert not torch.isfinite(ref_out).all() and torch.isfinite(ref_out).any()
                reached += int(not torch.isfinite(ref_out).all())
                what = f"{backend} {mode} {name}{list(at)}={value}"
                failures += _check(rank, group, pb, mode, backend, dtype, tol, what)
            # the group is still in step: a clean call agrees with the oracle
            what = f"{backend} {mode} clean call after the poisoned ones"
            failures += _check(rank, group, _problem(7), mode, backend, dtype, tol, what)
    return failures, reached


def _worker(rank, port, outdir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    res = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=60))  # fmt: skip
        group = dist.new_group(list(range(WORLD)))
        res["failures"], res["reached"] = _scenarios(rank, group)
        dist.destroy_process_group()
    except Exception:
        res["error"] = traceback.format_exc()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(res))


def test_nonfinite_inputs_propagate_like_the_oracle_and_never_hang(tmp_path):
    port = free_port()
    hung, codes = run_spawned(_worker, lambda r: (r, port, str(tmp_path)), WORLD, 240)
    assert not hung, f"ranks {hung} hung (a non-finite input desynchronised the group?)"
    for r in range(WORLD):
        f = Path(tmp_path, f"rank{r}.json")
        assert f.exists(), f"rank {r} died (exit code {codes[r]})"
        res = json.loads(f.read_text())
        assert "error" not in res, res["error"]
        assert not res["failures"], "\n".join(res["failures"])
        assert res["reached"] == 2 * len(MODES) * len(POISONS)
