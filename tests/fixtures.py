"""The tests' one fixture module: shared inputs (routings of every kind, random MoE problems,
the ring tests' global problems and their float64 oracle), tiny model configs (a tiny Hugging
Face Qwen3-MoE among them), and the spawn helpers (ports, spawned worlds, the persistent worlds
the ring scenarios run in: defined in ``tests/worlds.py``, re-exported here; Python and
relaymoe's CLI in a torchrun-like world of processes).

Library tests (``tests/lib``) import nothing from ``benchmarks``, and neither does this module:
the benchmarks keep their own spawn helpers (``benchmarks/numerics.py``), which import nothing
from the tests."""

from __future__ import annotations

import torch

# The spawn helpers live in tests/worlds.py (they need only torch: spawned ranks import them);
# re-exported here, the one module tests take their fixtures from.
from tests.worlds import (  # noqa: F401
    WORLD_MARK,
    World,
    Worlds,
    end_left_running,
    free_port,
    run_python,
    run_scenarios,
    run_spawned,
    scenario_params,
    start_python,
    world_mark,
)


def sm90_gpu_marks() -> list:
    """A GPU test module's ``pytestmark`` where its kernels need Hopper (fp8 tensor cores): the
    ``gpu`` mark, skipped without CUDA or on a GPU before sm90."""
    import pytest

    return [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        pytest.mark.skipif(
            torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
            reason="needs an sm90 GPU",
        ),
    ]


def needs(*modules: str):
    """A mark that skips a test (or, as ``pytestmark``, a module) where one of ``modules`` is
    not installed. It finds them without importing them: a test session imports every test
    module to collect it, and importing Megatron or transformers costs seconds of CPU in each
    process that collects, including those that run no test needing them."""
    import importlib.util

    import pytest

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package missing
            return False

    missing = [m for m in modules if not found(m)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


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


# Every expert MLP kind the tests cover: each activation name of relaymoe.activation.NAMES that
# Megatron builds, plus GPT-OSS's clamped SwiGLU (quick_gelu gate, clamp, offset)
EXPERT_ACTIVATIONS = {
    **{name: name for name in ("swiglu", "geglu", "geglu_tanh", "reglu", "gelu", "gelu_tanh",
                                "relu", "squared_relu", "silu")},
    "clamped_swiglu": dict(fn="silu", alpha=1.702, limit=7.0, linear_offset=1.0),
}  # fmt: skip
BIASES = ("none", "b13", "b2", "both")


def expert_activation(name: str):
    """The ``ExpertActivation`` of an ``EXPERT_ACTIVATIONS`` key."""
    from relaymoe.activation import ExpertActivation, as_activation

    spec = EXPERT_ACTIVATIONS[name]
    return ExpertActivation(**spec) if isinstance(spec, dict) else as_activation(spec)


def activation_problem(num_tokens, hidden, ffn, num_experts, topk, activation, *, bias="both",
                       dtype=torch.float64, gen=None, kind="uniform") -> dict:  # fmt: skip
    """A random MoE problem for ``activation`` (an ``EXPERT_ACTIVATIONS`` key or an
    ``ExpertActivation``): ``x``, ``w13`` (E, J, H) with J its fc1 rows, ``w2``, ``idx``,
    ``probs``, ``b13`` (E, J) / ``b2`` (E, H) as ``bias`` says (``BIASES``; None otherwise),
    ``dy``, ``act``. With a clamp ``limit`` the pre-activations are scaled to a standard
    deviation of about ``limit`` so that a good share of them is clamped on both sides."""
    act = expert_activation(activation) if isinstance(activation, str) else activation
    if bias not in BIASES:
        raise ValueError(bias)
    x, w13, w2, idx, probs = random_problem(num_tokens, hidden, ffn, num_experts, topk,
                                            dtype=dtype, gen=gen, kind=kind)  # fmt: skip
    w13 = w13[:, : act.fc1_rows(ffn)].contiguous()
    if act.limit is not None:
        w13 = w13 * act.limit
    rows = act.fc1_rows(ffn)
    b13 = 0.5 * torch.randn(num_experts, rows, generator=gen, dtype=dtype)
    b2 = 0.5 * torch.randn(num_experts, hidden, generator=gen, dtype=dtype)
    dy = torch.randn(num_tokens, hidden, generator=gen, dtype=dtype)
    return dict(x=x, w13=w13, w2=w2, idx=idx, probs=probs, dy=dy, act=act,
                b13=b13 if bias in ("b13", "both") else None,
                b2=b2 if bias in ("b2", "both") else None)  # fmt: skip


def ring_problem(seed, tokens, num_experts, topk, hidden, ffn, *, route="uniform") -> dict:
    """The float64 global problem every rank of a ring test builds from one ``seed``
    (``tokens``: each rank's token count): ``x``, ``w13``, ``w2``, ``idx``, ``probs`` (in
    [0.1, 1.1)), ``dy``. ``route``: ``uniform``; ``skew`` (experts 0..K only, the others
    empty); ``one`` (every token picks the last expert first, plus K-1 others). Its oracle:
    ``oracle``."""
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


def oracle(pb: dict) -> dict[str, torch.Tensor]:
    """Output and gradients of a whole problem (``ring_problem``'s keys) in float64:
    ``moe_experts_reference`` on ``x``, ``w13``, ``w2``, ``idx``, ``probs`` (as float64 copies),
    backward with ``dy``. Keys ``out``, ``dx``, ``dprobs``, ``dw13``, ``dw2``."""
    from relaymoe.reference import moe_experts_reference

    x, w13, w2, probs = (
        pb[k].double().clone().requires_grad_() for k in ("x", "w13", "w2", "probs")
    )
    out = moe_experts_reference(x, w13, w2, pb["idx"], probs)
    out.backward(pb["dy"].double())
    return dict(out=out.detach(), dx=x.grad, dprobs=probs.grad, dw13=w13.grad, dw2=w2.grad)


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


ACTIVATION_LEAVES = ("x", "w13", "w2", "probs", "b13", "b2")


def run_with_grads(fn, pb: dict, dtype=torch.float64, *, transpose_x=False,
                           retain_twice=False, **kw) -> dict[str, torch.Tensor]:  # fmt: skip
    """Output and gradients (keys ``out``, ``dx``, ``dw13``, ..., ``db13``/``db2`` when given)
    of ``fn`` (``moe_experts``' signature) on an ``activation_problem``, its float inputs cast to
    ``dtype``. ``transpose_x``: x passed as a transposed view; ``retain_twice``: the backward
    run twice through a retained graph (the gradients are then twice the one backward's)."""
    from relaymoe.reference import moe_experts_reference

    leaves = {n: pb[n].to(dtype).clone().requires_grad_() for n in ACTIVATION_LEAVES
              if pb[n] is not None}  # fmt: skip
    if transpose_x:
        leaves["x"] = pb["x"].to(dtype).t().contiguous().requires_grad_()
    x = leaves["x"].t() if transpose_x else leaves["x"]
    if transpose_x:
        assert not x.is_contiguous()
    out = fn(x, leaves["w13"], leaves["w2"], pb["idx"], leaves["probs"], activation=pb["act"],
             b13=leaves.get("b13"), b2=leaves.get("b2"), **kw)  # fmt: skip
    dy = pb["dy"].to(dtype)
    if out.grad_fn is None:  # the oracle without a single pair (T = 0): every gradient is zero
        assert fn is moe_experts_reference and out.numel() == 0
        grads = {f"d{n}": torch.zeros_like(t) for n, t in leaves.items()}
    else:
        out.backward(dy, retain_graph=retain_twice)
        if retain_twice:
            out.backward(dy)
        grads = {f"d{n}": t.grad for n, t in leaves.items()}
    if transpose_x:
        grads["dx"] = grads["dx"].t()
    return {"out": out.detach(), **grads}


def assert_all_close(got: dict, ref: dict, tol: float) -> None:
    """``got`` has ``ref``'s keys, each tensor within ``tol`` of ``ref``'s (``assert_close``)."""
    assert got.keys() == ref.keys()
    for name in ref:
        assert_close(name, got[name], ref[name], tol)


# ---------------------------------------------------------------------------------------------
# Megatron DDP's layouts and hook, without DDP (its buffers need CUDA and a model)
# ---------------------------------------------------------------------------------------------
def back_to_back(tensors, dtype=None) -> list[torch.Tensor]:
    """Views of one new buffer holding ``tensors``' values back to back in list order (DDP's
    param and grad buffers hold parameters in reverse registration order: pass them reversed)."""
    dtype = tensors[0].dtype if dtype is None else dtype
    buf = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    views, at = [], 0
    for t in tensors:
        views.append(buf[at : at + t.numel()].view(t.shape))
        at += t.numel()
    with torch.no_grad():
        for v, t in zip(views, tensors, strict=True):
            v.copy_(t)
    return views


def rehome(params) -> None:
    """``p.data`` of every parameter moved into one buffer, back to back in list order."""
    for p, view in zip(params, back_to_back([p.data for p in params]), strict=True):
        p.data = view


def attach_main_grads(params, generator, device="cpu") -> None:
    """Megatron DDP's attributes on ``params``: ``main_grad`` fp32 views of one buffer, back to
    back in list order, prefilled with ``generator``'s normal values (gradients of earlier
    micro-batches), and ``grad_added_to_main_grad`` False."""
    filled = [torch.randn(p.shape, generator=generator, device=device) for p in params]
    for p, view in zip(params, back_to_back(filled, torch.float32), strict=True):
        p.main_grad, p.grad_added_to_main_grad = view, False


def ddp_main_grad_hooks(params, keep: list) -> None:
    """Megatron DDP's hook on each parameter's gradient accumulator, buckets aside: it adds
    ``p.grad`` into ``main_grad`` unless the layer marked ``grad_added_to_main_grad``, then
    drops ``p.grad``. ``keep`` holds the accumulators (as DDP does, or the hooks go)."""
    for p in params:
        acc = p.expand_as(p).grad_fn.next_functions[0][0]

        def hook(*_, p=p):
            if p.grad is not None and not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad.data)
            p.grad = None

        acc.register_hook(hook)
        keep.append(acc)


def use_env(monkeypatch, **env):
    """Set (a value) or unset (None) ``RELAYMOE_*`` variables for this test (and any process it
    starts) and return the ``RingConfig`` they give, as an entry point would build it: pass it
    (or its ``kernels``) to what the test calls. A bad value raises ``from_env``'s
    ``ValueError`` here."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return env_config()


def env_config():
    """The ``RingConfig`` of this process's ``RELAYMOE_*`` environment
    (``relaymoe.options.from_env``): what an entry point would hand down."""
    from relaymoe import options

    return options.from_env()


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


# ---------------------------------------------------------------------------------------------
# A tiny Hugging Face Qwen3-MoE, and Python (relaymoe's CLI, a script) in worlds of processes
# ---------------------------------------------------------------------------------------------
# 2 layers, hidden 64, 4 query heads in 2 KV groups, 4 experts top-2, vocabulary 256, untied
TINY_QWEN3_MOE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    rope_theta=1e6,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)


def tiny_qwen3_moe(folder, *, seed: int = 7, **config):
    """transformers' ``Qwen3MoeForCausalLM`` of ``TINY_QWEN3_MOE`` (``config`` overrides keys),
    initialised at random (every norm weight too, around 1 and each entry different, so that a
    swapped q/k norm or input/post-attention norm shows), saved with ``save_pretrained`` in
    ``folder`` in several safetensors shards; returns the model (eval mode)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2 if "gate.weight" in name else 0.08)
    model.save_pretrained(str(folder), max_shard_size="60KB")
    return model


def safetensors_tensors(folder) -> dict:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    from pathlib import Path

    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def host_env(**extra) -> dict:
    """This process's environment for a host-only child (no GPU, one thread) that imports
    relaymoe from this checkout, plus ``extra``."""
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                PYTHONPATH=root + (os.pathsep + path if path else ""), **extra)  # fmt: skip


def run_world(args, world: int, *, cwd, timeout: float = 300,
              mark: str | None = None) -> list[tuple[int, str, str]]:  # fmt: skip
    """``python ARGS`` in ``world`` processes as ``torchrun --nproc-per-node WORLD`` starts them
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); (exit code, stdout, stderr) of each rank. One
    deadline for all: past it every process is killed and ``subprocess.TimeoutExpired`` raised.
    ``mark`` (``world_mark``): the ranks' ``WORLD_MARK``, for ``end_left_running`` to find what
    they leave behind."""
    import subprocess

    port = free_port()
    marked = {WORLD_MARK: mark} if mark is not None else {}
    procs = [start_python(list(args), cwd=cwd, env=host_env(
        RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), **marked)) for r in range(world)]  # fmt: skip
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, o, e))
    return out


def run_relaymoe(*args: str, cwd, world: int = 1, timeout: float = 300,
                 mark: str | None = None) -> tuple[int, str, str]:  # fmt: skip
    """``python -m relaymoe ARGS`` (one process, or a torchrun-like world of them, marked
    ``mark`` as ``run_world`` marks them): rank 0's (exit code, stdout, stderr), after asserting
    that every other rank exited as rank 0 did."""
    ranks = run_world(["-m", "relaymoe", *args], world, cwd=cwd, timeout=timeout, mark=mark)
    for r, (rc, _, err) in enumerate(ranks[1:], 1):
        assert rc == ranks[0][0] or rc == 0, f"rank {r}: exit {rc}\n{err[-3000:]}"
    return ranks[0]


def convert_hf(hf, ckpt, *extra: str, world: int = 1) -> list[str]:
    """``relaymoe convert-hf --hf HF --out CKPT --dtype fp32 EXTRA`` in ``world`` processes (add
    ``--ep``/``--pp`` to match), marked ``world_mark(CKPT)``; the model flags it wrote beside
    the checkpoint."""
    from pathlib import Path

    ckpt = Path(ckpt)
    rc, out, err = run_relaymoe("convert-hf", "--hf", str(hf), "--out", str(ckpt), "--dtype",
                                "fp32", *extra, cwd=ckpt.parent, world=world,
                                mark=world_mark(ckpt))  # fmt: skip
    assert rc == 0, out[-2000:] + err[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    return [f for f in (ckpt / "megatron_model_flags.txt").read_text().split("\n") if f]
