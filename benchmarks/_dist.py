"""Shared setup of the distributed benchmarks in this folder (memory timeline, ablation).

Works under ``torchrun`` (NCCL, one GPU per rank) and as a plain single process (world size 1,
a one-rank NCCL group so the same code paths run). Imports are local: importing this module
needs only torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    T: int  # tokens per GPU
    E: int
    K: int
    H: int
    I: int


def qwen3(T: int) -> Shape:
    return Shape(f"qwen3_30b_a3b_T{T // 1024}k", T, 128, 8, 2048, 768)


def init_dist() -> tuple[int, int, torch.distributed.ProcessGroup]:
    """(rank, world, EP group = WORLD); sets the CUDA device from LOCAL_RANK."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA (run it through scripts/gpu_suite.sh)")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(
                RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533"
            )
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD


def timed_collective(fn, warmup: int, reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` calls after ``warmup``, the slowest rank's.

    A fixed count on every rank: an adaptive count (``do_bench``) can differ between ranks and
    leave one waiting in a collective the other never issues.
    """
    import statistics

    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def make_inputs(shape: Shape, rank: int, world: int, *, dtype=torch.bfloat16, seed: int = 0):
    """This rank's tokens, its experts (global [rank*El, (rank+1)*El)) and a uniform-ish routing."""
    if shape.E % world:
        raise ValueError(f"E={shape.E} experts do not split over {world} ranks")
    El = shape.E // world
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    dev = "cuda"
    x = torch.randn(shape.T, shape.H, device=dev, dtype=dtype, generator=g)
    w13 = torch.randn(El, 2 * shape.I, shape.H, device=dev, dtype=dtype, generator=g)
    w13 *= shape.H**-0.5
    w2 = torch.randn(El, shape.H, shape.I, device=dev, dtype=dtype, generator=g) * shape.I**-0.5
    logits = torch.randn(shape.T, shape.E, device=dev, generator=g)
    probs, idx = torch.softmax(logits, -1).topk(shape.K, dim=-1)
    return x, w13, w2, idx, probs.to(dtype)


def build_mcore_alltoall(shape: Shape, world: int, *, dtype=torch.bfloat16):
    """megatron-core MoELayer (alltoall dispatcher, SequentialMLP experts, router included)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
        model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=shape.H,
        num_attention_heads=16,
        num_moe_experts=shape.E,
        moe_router_topk=shape.K,
        moe_ffn_hidden_size=shape.I,
        moe_token_dispatcher_type="alltoall",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        moe_grouped_gemm=False,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=world,
    )
    spec = get_gpt_layer_local_spec(num_experts=shape.E, moe_grouped_gemm=False)
    return spec.submodules.mlp(config=cfg).cuda().to(dtype)
