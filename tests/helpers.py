"""Shared test inputs: routings of every kind and random MoE problems."""

from __future__ import annotations

import torch

# One copy of the spawn helpers, in the benchmark that spawns worlds too (benchmarks may not
# import tests); re-exported here for the tests.
from benchmarks.numerics import free_port, run_spawned  # noqa: F401


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


def ring_problem(seed, tokens, num_experts, topk, hidden, ffn, *, route="uniform") -> dict:
    """The float64 global problem every rank of a ring test builds from one ``seed``
    (``tokens``: each rank's token count): ``x``, ``w13``, ``w2``, ``idx``, ``probs`` (in
    [0.1, 1.1)), ``dy``. ``route``: ``uniform``; ``skew`` (experts 0..K only, the others
    empty); ``one`` (every token picks the last expert first, plus K-1 others). The oracle of
    it: ``benchmarks.numerics.oracle``."""
    g = torch.Generator().manual_seed(seed)
    E, K, total = num_experts, topk, sum(tokens)
    f64 = torch.float64
    x = torch.randn(total, hidden, generator=g, dtype=f64)
    w13 = torch.randn(E, 2 * ffn, hidden, generator=g, dtype=f64) / hidden**0.5
    w2 = torch.randn(E, hidden, ffn, generator=g, dtype=f64) / ffn**0.5
    idx = torch.rand(total, E, generator=g).argsort(1)[:, :K]
    if route == "one" and total:
        others = torch.rand(total, E - 1, generator=g).argsort(1)[:, : K - 1]
        idx = torch.cat([torch.full((total, 1), E - 1), others], 1)
    elif route == "skew" and total:
        idx = torch.stack([torch.randperm(min(E, K + 1), generator=g)[:K] for _ in range(total)])
    elif route not in ("uniform", "one", "skew"):
        raise ValueError(route)
    probs = torch.rand(total, K, generator=g, dtype=f64) + 0.1
    dy = torch.randn(total, hidden, generator=g, dtype=f64)
    return dict(x=x, w13=w13, w2=w2, idx=idx, probs=probs, dy=dy)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """``got`` has ``ref``'s shape, is finite and within relative error ``tol`` of it (exactly
    zero where ``ref`` is); the message names ``name`` and the error."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if ref.norm() == 0:
        assert got.norm() == 0, f"{name}: expected exactly zero, got norm {got.norm()}"
        return
    err = rel_err(got, ref)
    assert err < tol, f"{name}: relative error {err:.3g} > {tol}"


def use_env(monkeypatch, **env) -> None:
    """Set (a value) or unset (None) ``RELAYMOE_*`` variables for this test and install the
    options they give, as an entry point would (the conftest restores the session's after the
    test). A bad value raises ``from_env``'s ``ValueError`` here."""
    from relaymoe import options

    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    options.install(options.from_env())


def _scenario_worker(rank, world, port, outdir, scenarios, timeout_s, backend):
    """One rank of ``run_scenarios``: every scenario on an explicit group of all ranks (the
    worker took the options of its environment when it imported ``tests``)."""
    import json
    import os
    import traceback
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    results = {}
    try:
        device_id = None
        if backend == "nccl":  # rank r on GPU r
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=timeout_s), device_id=device_id,
        )  # fmt: skip
        group = dist.new_group(list(range(world)))  # an explicit group, not the default
        for fn in scenarios:
            try:
                fn(rank, world, group)
                results[fn.__name__] = "ok"
            except Exception:
                results[fn.__name__] = traceback.format_exc()
        dist.destroy_process_group()
    except Exception:
        results["setup"] = traceback.format_exc()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(results))


def run_scenarios(scenarios, world: int, outdir, *, timeout: float, pg_timeout_s: int = 30,
                  backend: str = "gloo"):  # fmt: skip
    """Run every ``fn(rank, world, group)`` of ``scenarios`` (module-level functions) on each rank
    of a spawned world of ``world`` ranks (``backend`` ``gloo``, or ``nccl``: rank r on GPU r);
    fails the calling test when a rank hung, died or a scenario raised on any rank (the message
    holds every rank's traceback)."""
    import json
    from pathlib import Path

    port = free_port()
    args = (world, port, str(outdir), tuple(scenarios), pg_timeout_s, backend)
    hung, codes = run_spawned(_scenario_worker, lambda r: (r, *args), world, timeout)
    assert not hung, f"ranks {hung} hung (world {world})"
    failures = []
    for r in range(world):
        f = Path(outdir, f"rank{r}.json")
        assert f.exists(), f"rank {r} died (exit code {codes[r]})"
        res = json.loads(f.read_text())
        assert set(res) == {fn.__name__ for fn in scenarios} or "setup" in res, res.keys()
        failures += [f"rank {r} {name}:\n{msg}" for name, msg in res.items() if msg != "ok"]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# Tiny model configs: the one copy every test builds its small models from
# ---------------------------------------------------------------------------------------------
SMALL_MODEL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
    "vocab_size": 128,
}


def small_config_dict(**sections) -> dict:
    """A relaymoe config dict (``relaymoe.config.config_from_dict``) of a small MoE GPT: 2 layers,
    hidden 64, 4 experts top-2, vocabulary 128, sequence 128, micro-batch 2, one GPU. Each
    keyword names a section (``model``, ``parallel``, ``training``, ``relaymoe``) whose keys it
    updates. A fresh dict each call: tests may edit it."""
    d = {
        "model": dict(SMALL_MODEL),
        "parallel": {"tp": 1, "ep": 1, "sequence_parallel": False},
        "training": {"seq_length": 128, "micro_batch_size": 2},
    }
    for section, changes in sections.items():
        d.setdefault(section, {}).update(changes)
    return d


def small_config(name: str = "small", **sections):
    """``small_config_dict(**sections)`` as a validated ``relaymoe.config.Config``."""
    from relaymoe.config import config_from_dict

    return config_from_dict(small_config_dict(**sections), name=name)


def small_megatron_args(**over):
    """The small model as the argparse Namespace Megatron's ``parse_args`` would give (only the
    attributes the planner reads)."""
    import argparse

    # the config keys that are also Megatron argument names (GQA and kv_channels left unset)
    same = ("num_layers", "hidden_size", "num_attention_heads", "num_experts", "moe_router_topk",
            "moe_ffn_hidden_size", "vocab_size")  # fmt: skip
    kw = {k: SMALL_MODEL[k] for k in same}
    kw.update(seq_length=128, micro_batch_size=2, bf16=True)
    kw.update(over)
    return argparse.Namespace(**kw)


def tiny_transformer_config(*, moe: bool = True, **kw):
    """A megatron-core ``TransformerConfig`` of one tiny SwiGLU layer that builds on the CPU
    (hidden 16, 4 heads; with ``moe``: 8 experts top-2 of width 8, no load-balancing loss).
    Keywords override any field."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=8,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
    )
    if moe:
        base.update(
            num_moe_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=8,
            moe_router_load_balancing_type="none",
        )
    base.update(kw)
    return TransformerConfig(**base)


# The start of a one-process Megatron script on a CPU (``python -c``): gloo world of one,
# the CUDA queries Megatron makes answered for the CPU, relaymoe registered.
MEGATRON_CPU_PRELUDE = """\
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
torch.cuda.get_device_capability = lambda *a: (9, 0)  # validate_args asks for it
torch.cuda.current_device = lambda: "cpu"  # RoPE moves its frequencies there
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
from relaymoe.megatron import register
register()
"""
