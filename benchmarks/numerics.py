"""Numerics of ``ring_moe`` at scale: error against the float64 oracle for worlds 2, 4, 8 (gloo).

Issue #17 item 7. The ring carries its travelling accumulators in the activations' dtype: expert
mode the weight-gradient trail (one bf16 add per hop), token mode the output and dx/dprobs
trails (one bf16 add per hop) and the local weight gradients (one bf16 add per hop). The
all-to-all computes each weight gradient in one GEMM and sums each token's partial rows in fp32.
This harness measures whether that makes the ring's error grow with EP.

Per world ``R`` (spawned CPU processes, one gloo group), routing and seed: every rank builds the
same global problem (``R*T`` tokens, ``E = El*R`` experts) from the seed, rounds it to ``dtype``
and runs ``ring_moe`` on its slice with ``backend="torch"`` (the Triton interpreter gives wrong
bf16 results on CPU) for ``mode`` in expert, token, alltoall; forward, then backward with a fixed
``dy``. The parent gathers every rank's output, dx, dprobs and weight gradients and compares the
whole tensors with ``moe_experts_reference`` in float64 on the same rounded inputs (so the error
is the computation's, not the inputs' rounding): ``||a - b|| / ||b||`` (Frobenius).
``one_device`` rows: the same global problem through ``relaymoe.moe_experts`` on one process (no
EP), the floor the EP paths are compared with.

Shape legend: T tokens per rank, H hidden, I expert FFN width, El experts per rank, K top-k.

Rows (``bench="numerics"``): ``ep``, ``mode``, ``dtype``, ``prob_dtype``, ``routing``, ``shape``,
``H``, ``I``, ``E``, ``E_local``, ``K``, ``T`` (per rank), ``seed``, ``rel_err_out``,
``rel_err_dx``, ``rel_err_dw`` (w13 and w2 together), ``rel_err_dw13``, ``rel_err_dw2``,
``rel_err_dprobs``, ``backend``, ``relaymoe_tree`` (``clean``/``dirty``: ``git status`` of
``relaymoe/`` when the run started; ``git archive HEAD`` with ``--pin-head``), ``commit`` (HEAD),
and the environment keys of ``benchmarks/README.md``.

    python benchmarks/numerics.py [--worlds 2 4 8] [--seeds 0 1 2] [--pin-head] [--out PATH]
    python benchmarks/numerics.py --smoke      # world 2, tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import JsonlWriter, environment, print_table, rel_err  # noqa: E402

RING_MODES = ("expert", "token")
MODES = (*RING_MODES, "alltoall")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}  # fmt: skip
METRICS = ("out", "dx", "dw", "dw13", "dw2", "dprobs")
# the target: the ring's gradient error at most this multiple of the all-to-all's
RATIO_LIMIT = 2.0
_PIN_ENV = "RELAYMOE_NUMERICS_PINNED"  # the exported library the ranks must import


@dataclass(frozen=True)
class Config:
    """What one run measures. ``E = experts_per_rank * world``; ``tokens`` per rank."""

    hidden: int = 256
    ffn: int = 128
    experts_per_rank: int = 8
    topk: int = 4
    tokens: int = 512
    seeds: tuple[int, ...] = (0, 1, 2)
    routings: tuple[str, ...] = ("uniform", "skewed")
    dtypes: tuple[str, ...] = ("bf16",)
    modes: tuple[str, ...] = MODES
    world_timeout_s: float = 900.0
    grad_accum: str = "auto"  # ring_moe's weight-gradient accumulators (options.GRAD_ACCUMS)

    def shape(self) -> str:
        return f"H{self.hidden}_I{self.ffn}_El{self.experts_per_rank}_K{self.topk}_T{self.tokens}"


# ---------------------------------------------------------------------------------------------
# the global problem and the oracle
# ---------------------------------------------------------------------------------------------
def routing_ids(gen: torch.Generator, tokens: int, experts: int, topk: int, kind: str):
    """(tokens, topk) distinct global expert ids. ``uniform``: every expert equally likely.
    ``skewed``: 80% of tokens put their picks first on the hottest 20% of experts (the first
    ones, so the first ranks also get most of the pairs)."""
    if topk > experts:
        raise ValueError(f"topk={topk} exceeds the {experts} experts; lower --topk")
    scores = torch.rand(tokens, experts, generator=gen)
    if kind == "skewed":
        hot = max(1, experts // 5)
        scores[:, :hot] += 4.0 * (torch.rand(tokens, 1, generator=gen) < 0.8)
    elif kind != "uniform":
        raise ValueError(f"routing {kind!r}: use 'uniform' or 'skewed'")
    return scores.topk(topk, dim=1).indices


def make_problem(cfg: Config, world: int, seed: int, routing: str, dtype: torch.dtype) -> dict:
    """The global problem, rounded to ``dtype`` (probabilities to fp32 for 16-bit ``dtype``, as
    a Megatron router hands them over). Identical on every rank for one seed.

    ``x (R*T, H)``, ``w13 (E, 2I, H)``, ``w2 (E, H, I)``, ``idx (R*T, K)``, ``probs (R*T, K)``
    (top-k softmax weights, summing to one per token), ``dy (R*T, H)``.
    """
    H, I, K = cfg.hidden, cfg.ffn, cfg.topk
    E, N = cfg.experts_per_rank * world, cfg.tokens * world
    route_code = {"uniform": 1, "skewed": 2}.get(routing, 0)
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * world + route_code)
    f64 = torch.float64
    prob_dtype = torch.promote_types(dtype, torch.float32)
    return dict(
        x=torch.randn(N, H, generator=g, dtype=f64).to(dtype),
        w13=(torch.randn(E, 2 * I, H, generator=g, dtype=f64) * H**-0.5).to(dtype),
        w2=(torch.randn(E, H, I, generator=g, dtype=f64) * I**-0.5).to(dtype),
        idx=routing_ids(g, N, E, K, routing),
        probs=torch.softmax(torch.randn(N, K, generator=g, dtype=f64), -1).to(prob_dtype),
        dy=torch.randn(N, H, generator=g, dtype=f64).to(dtype),
    )


def _whole(fn, pb: dict, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Output and gradients of ``fn(x, w13, w2, idx, probs)`` on the whole problem, backward
    with ``dy``; the inputs in ``dtype`` (default: as they are)."""
    leaves = {
        k: pb[k].to(dtype or pb[k].dtype, copy=True).requires_grad_()
        for k in ("x", "w13", "w2", "probs")
    }
    out = fn(leaves["x"], leaves["w13"], leaves["w2"], pb["idx"], leaves["probs"])
    out.backward(pb["dy"].to(dtype or pb["dy"].dtype))
    return dict(
        out=out.detach(),
        dx=leaves["x"].grad,
        dprobs=leaves["probs"].grad,
        dw13=leaves["w13"].grad,
        dw2=leaves["w2"].grad,
    )


def oracle(pb: dict) -> dict[str, torch.Tensor]:
    """Output and gradients of the global problem in float64 (of the rounded inputs)."""
    from relaymoe.reference import moe_experts_reference

    return _whole(moe_experts_reference, pb, torch.float64)


def errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """``rel_err_<metric>`` of every metric; ``dw`` is w13's and w2's gradients as one vector."""
    res = {f"rel_err_{k}": rel_err(got[k], ref[k]) for k in ("out", "dx", "dw13", "dw2")}
    res["rel_err_dprobs"] = rel_err(got["dprobs"], ref["dprobs"])
    both = (
        torch.cat([got["dw13"].double().reshape(-1), got["dw2"].double().reshape(-1)]),
        torch.cat([ref["dw13"].reshape(-1), ref["dw2"].reshape(-1)]),
    )
    res["rel_err_dw"] = rel_err(*both)
    return {f"rel_err_{m}": res[f"rel_err_{m}"] for m in METRICS}


def one_device(pb: dict) -> dict[str, torch.Tensor]:
    """The global problem through ``relaymoe.moe_experts`` on this process (torch backend)."""
    from relaymoe import moe_experts

    return _whole(functools.partial(moe_experts, backend="torch"), pb)


# ---------------------------------------------------------------------------------------------
# the spawned ranks
# ---------------------------------------------------------------------------------------------
def _case_name(routing: str, seed: int, dtype: str, mode: str) -> str:
    return f"{routing}_s{seed}_{dtype}_{mode}"


def _run_rank(rank: int, world: int, group, cfg: Config, outdir: Path) -> None:
    import relaymoe
    from relaymoe.options import RingConfig
    from relaymoe.ring import ring_moe

    pinned = os.environ.get(_PIN_ENV)
    if pinned and not Path(relaymoe.__file__).is_relative_to(pinned):
        raise RuntimeError(f"relaymoe imported from {relaymoe.__file__}, not the pinned {pinned}")

    T, El = cfg.tokens, cfg.experts_per_rank
    rows, experts = slice(rank * T, (rank + 1) * T), slice(rank * El, (rank + 1) * El)
    for routing in cfg.routings:
        for seed in cfg.seeds:
            for dname in cfg.dtypes:
                pb = make_problem(cfg, world, seed, routing, DTYPES[dname])
                for mode in cfg.modes:
                    x = pb["x"][rows].clone().requires_grad_()
                    w13 = pb["w13"][experts].clone().requires_grad_()
                    w2 = pb["w2"][experts].clone().requires_grad_()
                    probs = pb["probs"][rows].clone().requires_grad_()
                    ring = RingConfig(mode=mode, transport="nccl", grad_accum=cfg.grad_accum)
                    out = ring_moe(x, w13, w2, pb["idx"][rows], probs, group=group,
                                   backend="torch", config=ring)  # fmt: skip
                    out.backward(pb["dy"][rows])
                    # clones: the ring's gradients may be views of one byte buffer
                    got = {k: v.detach().clone() for k, v in dict(
                        out=out, dx=x.grad, dprobs=probs.grad, dw13=w13.grad, dw2=w2.grad
                    ).items()}  # fmt: skip
                    torch.save(got, outdir / f"{_case_name(routing, seed, dname, mode)}_r{rank}.pt")


def _worker(rank: int, world: int, port: int, cfg: Config, outdir: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        _run_rank(rank, world, dist.group.WORLD, cfg, Path(outdir))
        dist.destroy_process_group()
    except Exception:
        Path(outdir, f"error_r{rank}.txt").write_text(traceback.format_exc())
        sys.exit(1)


def free_port() -> int:
    """A free TCP port on localhost for a spawned process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned(target, args_of_rank, world: int, timeout: float) -> tuple[list[int], list]:
    """Start ``target(*args_of_rank(r))`` for every rank in spawned processes under one deadline
    for the whole world; kill what is still alive then. Returns (ranks that hung, exit codes)."""
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


def run_world(world: int, cfg: Config, outdir: Path) -> None:
    """Spawn ``world`` ranks under one deadline; raise naming the ranks that hung or failed."""
    port = free_port()
    hung, codes = run_spawned(
        _worker, lambda r: (r, world, port, cfg, str(outdir)), world, cfg.world_timeout_s
    )
    errs = sorted(outdir.glob("error_r*.txt"))
    if hung or errs or any(c != 0 for c in codes):
        detail = "\n".join(f"{f.name}:\n{f.read_text()}" for f in errs)
        hang = f"ranks {hung} hung past {cfg.world_timeout_s:.0f} s (raise --world-timeout-s); "
        raise RuntimeError(f"world {world}: {hang if hung else ''}exit codes {codes}\n{detail}")


def gather(outdir: Path, case: str, world: int) -> dict[str, torch.Tensor]:
    """Every rank's pieces of one case as global tensors: tokens and experts in rank order."""
    parts = [torch.load(outdir / f"{case}_r{r}.pt") for r in range(world)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# ---------------------------------------------------------------------------------------------
# provenance, driver, summary
# ---------------------------------------------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout


def pin_head(dest: Path) -> Path:
    """Export ``relaymoe/`` of HEAD into ``dest`` and import it from there (this process and
    the spawned ranks): the rows then measure exactly the committed library even while the
    working tree changes."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "HEAD", "relaymoe"], capture_output=True, check=True
    ).stdout
    if "relaymoe" in sys.modules:
        raise RuntimeError("pin_head must run before relaymoe is imported")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    sys.path.insert(0, str(dest))
    os.environ[_PIN_ENV] = str(dest)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(dest), os.environ.get(
        "PYTHONPATH")]))  # fmt: skip
    return dest


def provenance(pinned: bool) -> dict:
    """``commit``: HEAD; ``relaymoe_tree``: what the library's source was."""
    head = _git("rev-parse", "--short=12", "HEAD").strip()
    if pinned:
        tree = "git archive HEAD"
    else:
        tree = "dirty" if _git("status", "--short", "relaymoe/").strip() else "clean"
    return {"commit": head, "relaymoe_tree": tree}


def measure(cfg: Config, worlds: list[int], writer: JsonlWriter | None, log=print) -> list[dict]:
    """All rows of ``cfg`` over ``worlds``; written to ``writer`` as they come."""
    rows: list[dict] = []
    base = dict(bench="numerics", provider="relaymoe", shape=cfg.shape(), H=cfg.hidden,
                I=cfg.ffn, E_local=cfg.experts_per_rank, K=cfg.topk, T=cfg.tokens,
                backend="torch")  # fmt: skip
    for world in worlds:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"relaymoe_numerics_w{world}_") as tmp:
            run_world(world, cfg, Path(tmp))
            for routing in cfg.routings:
                for seed in cfg.seeds:
                    for dname in cfg.dtypes:
                        pb = make_problem(cfg, world, seed, routing, DTYPES[dname])
                        ref = oracle(pb)
                        acc = resolved_accum(cfg.grad_accum, world, dname)
                        common = dict(base, ep=world, E=cfg.experts_per_rank * world,
                                      dtype=dname, prob_dtype=str(pb["probs"].dtype)[6:],
                                      routing=routing, seed=seed, grad_accum=acc)  # fmt: skip
                        cases = [(m, gather(Path(tmp), _case_name(routing, seed, dname, m), world))
                                 for m in cfg.modes]  # fmt: skip
                        cases.append(("one_device", one_device(pb)))
                        for mode, got in cases:
                            row = dict(common, mode=mode, **errors(got, ref))
                            rows.append(writer.write(row) if writer is not None else row)
        log(f"world {world}: {time.perf_counter() - t0:.1f} s")
    return rows


def resolved_accum(choice: str, world: int, dname: str) -> str:
    """What ``grad_accum=choice`` runs as for this EP and dtype: ``param`` or ``fp32``."""
    from relaymoe.cost import grad_accum_bytes

    b = DTYPES[dname].itemsize
    return "fp32" if grad_accum_bytes(choice, world, b) > b else "param"


def summarize(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(per (ep, routing, dtype, accumulators, mode) means over seeds, ring/alltoall ratios of
    those means). Rows without ``grad_accum`` ran before it existed: 16-bit (``param``)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["ep"], r["routing"], r["dtype"], r.get("grad_accum", "param"), r["mode"])
        groups.setdefault(key, []).append(r)
    means = []
    for (ep, routing, dname, acc, mode), rs in sorted(groups.items()):
        m = dict(ep=ep, routing=routing, dtype=dname, grad_accum=acc, mode=mode, seeds=len(rs))
        for k in METRICS:
            m[k] = sum(r[f"rel_err_{k}"] for r in rs) / len(rs)
        means.append(m)
    by = {(m["ep"], m["routing"], m["dtype"], m["grad_accum"], m["mode"]): m for m in means}
    ratios = []
    for (ep, routing, dname, acc, mode), m in sorted(by.items()):
        a2a = by.get((ep, routing, dname, acc, "alltoall"))
        if mode not in RING_MODES or a2a is None:
            continue
        rr = dict(ep=ep, routing=routing, dtype=dname, grad_accum=acc, mode=f"{mode}/alltoall")
        for k in METRICS:
            rr[k] = m[k] / a2a[k] if a2a[k] > 0 else math.inf
        rr["max_grad_ratio"] = max(rr[k] for k in ("dx", "dw13", "dw2", "dprobs"))
        rr["ok"] = rr["max_grad_ratio"] <= RATIO_LIMIT
        ratios.append(rr)
    return means, ratios


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--routings", nargs="+", default=["uniform", "skewed"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--world-timeout-s", type=float, default=900.0)
    ap.add_argument("--grad-accum", default="auto", help="the ring's weight-gradient "
                    "accumulators: auto, param or fp32")  # fmt: skip
    ap.add_argument(
        "--pin-head",
        action="store_true",
        help="measure relaymoe/ as committed at HEAD (git archive), not the working tree",
    )
    ap.add_argument("--smoke", action="store_true", help="world 2, tiny shapes, one seed")
    ap.add_argument("--out", default=None, help="rows (.jsonl, appended); none: print only")
    a = ap.parse_args(argv)
    if a.smoke:
        a.worlds, a.seeds, a.hidden, a.ffn, a.experts_per_rank, a.tokens = [2], [0], 32, 16, 2, 24
        a.topk = 2
    pin_dir = tempfile.mkdtemp(prefix="relaymoe_head_") if a.pin_head else None
    try:
        if pin_dir is not None:
            pin_head(Path(pin_dir))
        return _run(a, pin_dir)
    finally:
        if pin_dir is not None:
            shutil.rmtree(pin_dir, ignore_errors=True)


def _run(a: argparse.Namespace, pin_dir: str | None) -> list[dict]:
    from relaymoe.options import GRAD_ACCUM_CHOICES

    if a.grad_accum not in GRAD_ACCUM_CHOICES:
        raise SystemExit(f"--grad-accum {a.grad_accum!r}: choose from {GRAD_ACCUM_CHOICES}")
    cfg = Config(
        hidden=a.hidden, ffn=a.ffn, experts_per_rank=a.experts_per_rank, topk=a.topk,
        tokens=a.tokens, seeds=tuple(a.seeds), routings=tuple(a.routings),
        dtypes=tuple(a.dtypes), world_timeout_s=a.world_timeout_s, grad_accum=a.grad_accum,
    )  # fmt: skip
    env = {**environment(), **provenance(pin_dir is not None)}
    if pin_dir is not None:
        import relaymoe

        if not Path(relaymoe.__file__).is_relative_to(pin_dir):
            raise RuntimeError(f"relaymoe imported from {relaymoe.__file__}, not {pin_dir}")
    writer = JsonlWriter(a.out, env=env) if a.out else None
    print(f"config: {asdict(cfg)}  commit {env['commit']} ({env['relaymoe_tree']})", flush=True)
    rows = measure(cfg, a.worlds, writer, log=lambda s: print(s, flush=True))
    means, ratios = summarize(rows)
    print("\nrelative error vs the float64 oracle (mean over seeds)")
    print_table(means, ["ep", "routing", "dtype", "grad_accum", "mode", "seeds", *METRICS])
    print(f"\nring / alltoall (ok: every gradient ratio <= {RATIO_LIMIT})")
    print_table(ratios, ["ep", "routing", "dtype", "grad_accum", "mode", *METRICS,
                         "max_grad_ratio", "ok"])  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
