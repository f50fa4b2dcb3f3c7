"""MoELayer with ``--moe-token-dispatcher-type ring`` vs Megatron's own allgather dispatcher.

Each world size (EP = 1, 2, 4) is one spawned gloo world (``gloo_worlds``), which also runs the
jobs at TP = 2 with sequence parallelism and EP = 2 (world 4) and at CP = 2 (worlds 2 and 4).
In every rank:

* a ring ``MoELayer`` at EP = world (its own slice of the experts, its own tokens; uneven token
  counts across ranks), built through ``register()``'s patched ``MoELayer``;
* a reference ``MoELayer`` with the stock allgather dispatcher at EP = 1 holding all experts,
  run on the union of every rank's tokens (megatron's allgather cannot run at EP > 1 on CPU: it
  allocates its gather buffer with ``torch.cuda.current_device()``). At EP = 1 this is the plain
  allgather-vs-ring comparison on the same tokens.

Both get identical weights; outputs, the input gradient, every expert weight gradient, the
router gradient and the shared-expert gradients (summed over ranks, as DP would) must agree in
fp32. Megatron's router moves its weight to CUDA in ``gating``: the tests pass a CPU-safe
``TopKRouter`` subclass through ``MoESubmodules.router``.

One case runs under Megatron's MoE activation recompute (``recompute_modules=["moe"]``: the
router and the ring replay in backward). At EP = 1 only (where both layers route the same
tokens), router losses and expert bias too: aux, sequence-aux and global-aux loss, z-loss, a
non-zero expert bias with a sigmoid fp32 router; their gradients must reach the router and the
input through the ring unchanged.

Then checkpoint interchange: alltoall and ring layers of the same EP have identical
``state_dict`` and ``sharded_state_dict`` keys (and sharding metadata), and a checkpoint saved
through Megatron's distributed checkpointing from one loads into the other.

The ring is ``relaymoe.ring.ring_moe``; the integration tests also run with a stand-in defined
here (all-gather the tokens, compute local experts with the float64-capable oracle, all-reduce
the outputs) patched over the dispatcher's ``ring_moe``, which isolates the Megatron side from
the ring engine.
"""

from __future__ import annotations

import dataclasses
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.fixtures import assert_close, tiny_transformer_config

pytestmark = pytest.mark.slow

H, I_FFN, B = 16, 8, 2


# ------------------------------------------------------------------------------ stand-in ring
class _AllgatherRing(torch.autograd.Function):
    """ring_moe's contract, the slow way: gather tokens, local experts, all-reduce outputs
    (any ``ExpertActivation``, optional ``b13 (El, J)`` / ``b2 (El, H)`` biases)."""

    @staticmethod
    def forward(ctx, x, w13, w2, idx, probs, group, activation, b13, b2):
        from relaymoe.reference import moe_experts_reference

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        el = w13.shape[0]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([x.shape[0]]), group=group)
        sizes = [int(s) for s in sizes]
        tmax = max(sizes)

        def gather(t):
            pad = t.new_zeros((tmax, *t.shape[1:]))
            pad[: t.shape[0]] = t
            bufs = [torch.empty_like(pad) for _ in range(world)]
            dist.all_gather(bufs, pad.contiguous(), group=group)
            return torch.cat([b[:n] for b, n in zip(bufs, sizes, strict=True)])

        def leaf(t):
            return None if t is None else t.detach().requires_grad_(True)

        with torch.enable_grad():
            xa = gather(x.detach()).requires_grad_(True)
            pa = gather(probs.detach()).requires_grad_(True)
            ia = gather(idx)
            mine = (ia >= rank * el) & (ia < (rank + 1) * el)
            il = torch.where(mine, ia - rank * el, torch.zeros_like(ia))
            pl = torch.where(mine, pa, torch.zeros_like(pa))
            w13l, w2l, b13l, b2l = leaf(w13), leaf(w2), leaf(b13), leaf(b2)
            y = moe_experts_reference(xa, w13l, w2l, il, pl, activation=activation, b13=b13l,
                                      b2=b2l)  # fmt: skip
        full = y.detach().clone()
        dist.all_reduce(full, group=group)
        start = sum(sizes[:rank])
        ctx.state = (xa, pa, w13l, w2l, b13l, b2l, y, sizes, start, group)
        return full[start : start + x.shape[0]].clone()

    @staticmethod
    def backward(ctx, g):
        xa, pa, w13l, w2l, b13l, b2l, y, sizes, start, group = ctx.state
        world = len(sizes)
        tmax = max(sizes)
        pad = g.new_zeros((tmax, g.shape[1]))
        pad[: g.shape[0]] = g
        bufs = [torch.empty_like(pad) for _ in range(world)]
        dist.all_gather(bufs, pad.contiguous(), group=group)
        ga = torch.cat([b[:n] for b, n in zip(bufs, sizes, strict=True)])
        inputs = [t for t in (xa, pa, w13l, w2l, b13l, b2l) if t is not None]
        grads = iter(torch.autograd.grad(y, inputs, ga, allow_unused=True))
        dx, dp, dw13, dw2 = (next(grads) for _ in range(4))
        db13 = None if b13l is None else next(grads)
        db2 = None if b2l is None else next(grads)
        dist.all_reduce(dx, group=group)
        dist.all_reduce(dp, group=group)
        n = g.shape[0]
        ctx.state = None
        return dx[start : start + n], dw13, dw2, None, dp[start : start + n], None, None, db13, db2


STANDIN_CALLS = [0]  # per process: proves the patched dispatcher called the stand-in
STANDIN_SEEN: list = []  # per process: (activation, has b13, has b2) of each call


def standin_ring_moe(
    x,
    w13,
    w2,
    topk_idx,
    topk_probs,
    *,
    group=None,
    backend="auto",
    trusted=False,
    activation=None,
    b13=None,
    b2=None,
    capturable=False,
    config=None,
    runtime=None,
    main_grads=None,
):
    """``ring_moe``'s signature (options only in ``config``: a dispatcher passing one of the
    removed option keywords raises TypeError here, as it would there) over an all-gather;
    without gradient-accumulation fusion (``main_grads`` None: the gradients reach ``.grad``)."""
    from relaymoe.activation import ExpertActivation
    from relaymoe.options import (
        GRAD_ACCUM_CHOICES,
        MODE_CHOICES,
        SCHEDULE_CHOICES,
        TRANSPORT_CHOICES,
        RingConfig,
    )
    from relaymoe.ring import RingRuntime

    # the dispatcher hands its config and its runtime down: every option in the config
    assert isinstance(config, RingConfig) and isinstance(runtime, RingRuntime), (config, runtime)
    assert trusted and backend == "auto", (trusted, backend)
    assert config.mode in MODE_CHOICES and config.transport in TRANSPORT_CHOICES, config
    # one node, no --relaymoe-gpus-per-node: the ring reads the hosts
    assert config.schedule in SCHEDULE_CHOICES and config.gpus_per_node is None, config
    assert config.grad_accum in GRAD_ACCUM_CHOICES, config
    assert activation is None or isinstance(activation, ExpertActivation), activation
    assert main_grads is None, "the stand-in returns its gradients: no main_grad here"
    STANDIN_CALLS[0] += 1
    STANDIN_SEEN.append((activation, b13 is not None, b2 is not None))

    def stacked(t):  # ring_moe's list form: per-expert parameters
        return torch.stack(list(t)) if isinstance(t, (list, tuple)) else t

    w13, w2, b13, b2 = stacked(w13), stacked(w2), stacked(b13), stacked(b2)
    return _AllgatherRing.apply(x, w13, w2, topk_idx, topk_probs, group, activation, b13, b2)


# ------------------------------------------------------------------------------ megatron setup
def _cpu_router_cls():
    from megatron.core.transformer.moe.router import TopKRouter

    class CpuTopKRouter(TopKRouter):
        """TopKRouter whose gating stays on the weight's device (megatron moves it to CUDA)."""

        def gating(self, input):
            dtype = input.dtype
            if self.config.moe_router_dtype == "fp32":
                dtype = torch.float32
            elif self.config.moe_router_dtype == "fp64":
                dtype = torch.float64
            return F.linear(input.to(dtype), self.weight.to(dtype))

    return CpuTopKRouter


def make_config(dispatcher: str, ep: int, **kw):
    base = dict(
        hidden_size=H,
        moe_ffn_hidden_size=I_FFN,
        ffn_hidden_size=I_FFN,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        params_dtype=torch.float32,
        moe_token_dispatcher_type=dispatcher,
    )
    return tiny_transformer_config(**{**base, **kw})


def build_layer(config, pgs):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    sub = dataclasses.replace(spec.keywords["submodules"], router=_cpu_router_cls())
    return spec.func(config, submodules=sub, layer_number=1, pg_collection=pgs)


def single_rank_pgs(rank: int, world: int):
    """A ProcessGroupCollection in which every group is this rank alone (EP = TP = 1)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    mine = None
    for r in range(world):  # new_group is collective: every rank creates every group
        g = dist.new_group([r])
        if r == rank:
            mine = g
    pgs = ProcessGroupCollection()
    for name in ("tp", "cp", "tp_cp", "tp_dp_cp", "dp", "dp_cp", "ep", "expt_tp", "tp_ep"):
        setattr(pgs, name, mine)
    pgs.expt_dp = mine
    return pgs


def _init(rank: int, world: int, tp: int = 1, cp: int = 1) -> None:
    """Megatron's parallel state over the world's default process group (set up by the world,
    ``tests/worlds.py``); ``_done`` tears it down, so the next scenario of the world starts
    afresh."""
    warnings.filterwarnings("ignore")
    # Megatron's router registers its expert-bias and global-aux-loss buffers on
    # torch.cuda.current_device(): on this CPU-only worker, "the current device" is the CPU.
    torch.cuda.current_device = lambda: "cpu"
    # Megatron's activation checkpoint saves and restores the CUDA RNG with the CPU one; here
    # there is only the CPU one (restored as usual), so the CUDA half is a no-op.
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    from megatron.core import parallel_state as ps

    assert dist.get_world_size() == world and dist.get_rank() == rank
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        expert_model_parallel_size=world // tp,
        expert_tensor_parallel_size=1,
        create_gloo_process_groups=False,
    )
    import relaymoe.megatron as rm

    rm.register()


def _done() -> None:
    from megatron.core import parallel_state as ps

    dist.barrier()
    ps.destroy_model_parallel()


def ring_impl(impl: str):
    """``"ring"``: the dispatcher's own ``relaymoe.ring.ring_moe``; ``"standin"``: the stand-in
    patched over it for the duration (this spawned process only)."""
    import contextlib

    import relaymoe.megatron.dispatcher as disp

    if impl == "ring":
        return contextlib.nullcontext()
    assert impl == "standin", impl
    return mock.patch.object(disp, "ring_moe", standin_ring_moe)


# ---------------------------------------------------------------------------- weights/inputs
def global_weights(cfg, seed: int, *, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    e, i, h = cfg.num_moe_experts, cfg.moe_ffn_hidden_size, cfg.hidden_size
    gate = 2 if cfg.gated_linear_unit else 1  # fc1 rows per FFN column
    w = {
        "router": torch.randn(e, h, generator=g) * 0.5,
        "fc1": torch.randn(e, gate * i, h, generator=g) / h**0.5,
        "fc2": torch.randn(e, h, i, generator=g) / i**0.5,
    }
    if cfg.add_bias_linear:  # the experts' (and the router's) biases, non-zero: they count
        w["b1"] = torch.randn(e, gate * i, generator=g) * 0.5
        w["b2"] = torch.randn(e, h, generator=g) * 0.5
        w["router_bias"] = torch.randn(e, generator=g) * 0.1
    if skew:  # every token prefers experts 0..K-1: the other experts (and ranks) get nothing
        w["router"][: cfg.moe_router_topk] += 50.0
        w["router"][: cfg.moe_router_topk] = w["router"][: cfg.moe_router_topk].abs()
    if cfg.moe_router_enable_expert_bias:  # as if load balancing had already moved it
        w["expert_bias"] = torch.randn(e, generator=g)
    if cfg.moe_shared_expert_intermediate_size:
        s = cfg.moe_shared_expert_intermediate_size
        w["sh1"] = torch.randn(gate * s, h, generator=g) / h**0.5
        w["sh2"] = torch.randn(h, s, generator=g) / s**0.5
    return w


@torch.no_grad()
def load_weights(layer, w, first: int, count: int) -> None:
    layer.router.weight.copy_(w["router"])
    if "router_bias" in w:
        layer.router.bias.copy_(w["router_bias"])
    if "expert_bias" in w:
        layer.router.expert_bias.copy_(w["expert_bias"])
    for j, ex in enumerate(layer.experts.local_experts):
        assert j < count
        ex.linear_fc1.weight.copy_(w["fc1"][first + j])
        ex.linear_fc2.weight.copy_(w["fc2"][first + j])
        if "b1" in w:
            ex.linear_fc1.bias.copy_(w["b1"][first + j])
            ex.linear_fc2.bias.copy_(w["b2"][first + j])
    if "sh1" in w:
        layer.shared_experts.linear_fc1.weight.copy_(w["sh1"])
        layer.shared_experts.linear_fc2.weight.copy_(w["sh2"])


@torch.no_grad()
def rehome_like_ddp(layer, order: str) -> None:
    """Move the ring layer's expert parameters into one flat buffer the way Megatron's DDP does
    (``param.data = view``, reverse order): ``"ddp"`` reverses SequentialMLP's registration
    order (fc1/fc2 of an expert interleaved: no list is back to back), ``"reversed"`` reverses
    TEGroupedMLP's (all fc1 then all fc2: each list back to back in reverse expert order)."""
    from relaymoe.megatron.expert_weights import expert_param_lists, expert_weights_layout

    fc1, fc2 = expert_param_lists(layer.experts)
    if order == "ddp":
        registered = [p for a, b in zip(fc1, fc2, strict=True) for p in (a, b)]
    else:
        registered = fc1 + fc2
    params = registered[::-1]
    buf = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    at = 0
    for p in params:
        view = buf[at : at + p.numel()].view(p.shape)
        view.copy_(p.data)
        p.data = view
        at += p.numel()
    want = (None, None) if order == "ddp" and len(fc1) > 1 else ("reversed", "reversed")
    if len(fc1) == 1:
        want = ("forward", "forward")
    assert expert_weights_layout(layer.experts) == want, expert_weights_layout(layer.experts)


def ring_saves_no_weight_copy(out, layer) -> None:
    """The ring node of ``out``'s graph saves the expert parameters themselves, nothing the
    size of a stacked (El, ...) copy of them."""
    from relaymoe.megatron.expert_weights import expert_param_lists

    seen, stack, node = set(), [out.grad_fn], None
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "RingMoE" in type(fn).__name__:
            node = fn
            break
        stack.extend(f for f, _ in fn.next_functions)
    assert node is not None, "no ring node in the MoELayer's graph"
    fc1, fc2 = expert_param_lists(layer.experts)
    params = {p.data_ptr() for p in fc1 + fc2}
    el = len(fc1)
    stacked = {(el, *fc1[0].shape), (el, *fc2[0].shape)}
    weights = [t for t in node.saved_tensors if t.dim() == 2 and t.data_ptr() in params]
    assert len(weights) == 2 * el, "the ring does not save the parameters themselves"
    copies = [t for t in node.saved_tensors if tuple(t.shape) in stacked]
    assert not copies, f"the ring saves a stacked copy of the expert weights: {copies[0].shape}"


def check_close(name, got, ref, tol=2e-5):  # fp32 vs fp32: accumulation order only
    assert_close(name, got, ref, tol)


# ------------------------------------------------------------------------------ the cases
def run_equivalence(rank, world, case: dict, tp: int = 1, cp: int = 1, real: bool = True) -> None:
    """``tp > 1``: tensor parallel with sequence parallelism, EP = world / tp; each rank holds a
    distinct sequence shard (as TP ranks do) and experts repeat over the expert-data-parallel
    ranks, whose expert gradients DDP would sum. ``cp > 1``: context parallel, each rank a
    distinct chunk of the sequence; the expert-parallel group spans the CP ranks. ``real``:
    the layer runs relaymoe's ring (not the stand-in)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    kw = dict(case.get("config", {}))
    ep = world // tp
    if tp > 1:
        kw.update(tensor_model_parallel_size=tp, sequence_parallel=True)
    if cp > 1:
        kw.update(context_parallel_size=cp)
        # the ring's group really crosses the CP ranks (whose tokens differ)
        assert ps.get_context_parallel_world_size() == cp
        assert ps.get_expert_model_parallel_world_size() == ep == world
    cfg_ring = make_config("ring", ep, **kw)
    ref_kw = {k: v for k, v in kw.items() if k not in ("tensor_model_parallel_size",
                                                        "sequence_parallel",
                                                        "context_parallel_size")}  # fmt: skip
    cfg_ref = make_config("allgather", 1, **{**ref_kw, "expert_model_parallel_size": 1})
    ring = build_layer(cfg_ring, ProcessGroupCollection.use_mpu_process_groups())
    ref = build_layer(cfg_ref, single_rank_pgs(rank, world))
    if cfg_ref.add_bias_linear:
        # megatron-core's SequentialMLP adds fc2's bias in place into fc2's output, which at
        # TP = EP = 1 is the TP all-reduce's input returned as-is (autograd refuses); at EP > 1
        # the experts skip that all-reduce ("explicit expert comm"), the identity at TP = 1
        for ex in ref.experts.local_experts:
            ex.linear_fc2.explicit_expert_comm = True
    from relaymoe.megatron.dispatcher import RingDispatcher

    assert isinstance(ring.token_dispatcher, RingDispatcher)
    assert ring.moe_layer_recompute == ("moe" in (kw.get("recompute_modules") or []))
    assert type(ref.token_dispatcher).__name__ == "MoEAllGatherTokenDispatcher"
    el = cfg_ring.num_moe_experts // ep
    ep_rank = ps.get_expert_model_parallel_rank()
    w = global_weights(cfg_ring, seed=case["seed"], skew=case.get("skew", False))
    load_weights(ring, w, ep_rank * el, el)
    load_weights(ref, w, 0, cfg_ring.num_moe_experts)
    if case.get("layout"):
        rehome_like_ddp(ring, case["layout"])
    ring.train()
    ref.train()

    g = torch.Generator().manual_seed(case["seed"] + 1)
    seqs = [case.get("seq", 5) + (r if case.get("uneven", True) else 0) for r in range(world)]
    xs = [torch.randn(s, B, H, generator=g) for s in seqs]
    gs = [torch.randn(s, B, H, generator=g) for s in seqs]
    start = sum(seqs[:rank])

    x_ref = torch.cat(xs).requires_grad_(True)
    out_ref, _ = ref(x_ref)
    (out_ref * torch.cat(gs)).sum().backward()

    x = xs[rank].clone().requires_grad_(True)
    out, bias = ring(x)
    assert bias is None
    if real and not kw.get("recompute_modules"):
        ring_saves_no_weight_copy(out, ring)  # (under recompute the graph holds a checkpoint)
    # poison: the ring output must not alias anything we later overwrite
    (out * gs[rank]).sum().backward()

    tag = f"[EP={ep} TP={tp} CP={cp} rank={rank} {case['name']}]"
    check_close(f"{tag} output", out, out_ref[start : start + seqs[rank]])
    check_close(f"{tag} d input", x.grad, x_ref.grad[start : start + seqs[rank]])
    edp = ps.get_expert_data_parallel_group() if world > ep else None
    for j, ex in enumerate(ring.experts.local_experts):
        rex = ref.experts.local_experts[ep_rank * el + j]
        d1, d2 = ex.linear_fc1.weight.grad.clone(), ex.linear_fc2.weight.grad.clone()
        if edp is not None:  # the ranks holding the same experts: DDP sums their gradients
            dist.all_reduce(d1, group=edp)
            dist.all_reduce(d2, group=edp)
        check_close(f"{tag} d fc1[{j}]", d1, rex.linear_fc1.weight.grad)
        check_close(f"{tag} d fc2[{j}]", d2, rex.linear_fc2.weight.grad)
        for k, (lin, rlin) in enumerate(((ex.linear_fc1, rex.linear_fc1),
                                         (ex.linear_fc2, rex.linear_fc2))):  # fmt: skip
            if rlin.bias is None:
                assert lin.bias is None
                continue
            db = lin.bias.grad.clone()
            if edp is not None:
                dist.all_reduce(db, group=edp)
            check_close(f"{tag} d fc{k + 1} bias[{j}]", db, rlin.bias.grad)
    summed = [ring.router.weight.grad.clone()]
    ref_summed = [ref.router.weight.grad]
    if ring.shared_experts is not None:
        summed += [
            ring.shared_experts.linear_fc1.weight.grad.clone(),
            ring.shared_experts.linear_fc2.weight.grad.clone(),
        ]
        ref_summed += [
            ref.shared_experts.linear_fc1.weight.grad,
            ref.shared_experts.linear_fc2.weight.grad,
        ]
    for k, (t, r) in enumerate(zip(summed, ref_summed, strict=True)):
        dist.all_reduce(t)  # what DP's gradient all-reduce does with these replicated params
        check_close(f"{tag} d replicated param {k} (router, shared...)", t, r)


def _sd_meta(sd):
    out = {}
    for k, v in sd.items():
        key = getattr(v, "key", None)
        out[k] = (
            key,
            tuple(getattr(v, "global_offset", ()) or ()),
            tuple(getattr(v, "global_shape", ()) or ()),
            tuple(getattr(v, "axis_fragmentations", ()) or ()),
        )
    return out


def run_checkpoint_interchange(rank, world, **config) -> None:
    """``config``: fields of both layers beyond the tiny SwiGLU layer's (e.g. another expert
    activation, biases)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # The alltoall dispatcher creates a CUDA stream at construction; we never run it here.
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "unused on CPU"
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    kw = {"moe_shared_expert_intermediate_size": 12, **config}
    a2a = build_layer(make_config("alltoall", world, **kw), pgs)
    ring = build_layer(make_config("ring", world, **kw), pgs)
    assert type(a2a.token_dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
    w = global_weights(a2a.config, seed=7)
    el = 8 // world
    load_weights(a2a, w, rank * el, el)

    # plain state_dict: same keys, and values carried over exactly, both ways
    sd_a = a2a.state_dict()
    assert sorted(sd_a) == sorted(ring.state_dict()), "state_dict keys differ alltoall vs ring"
    biases = [k for k in sd_a if ".local_experts." in k and k.endswith(".bias")]
    assert bool(biases) == bool(config.get("add_bias_linear")), biases  # the experts' own
    ring.load_state_dict(sd_a)
    for k, v in ring.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, sd_a[k]), f"state_dict value {k} differs after load"

    # sharded_state_dict: same keys and same global sharding metadata
    meta_a, meta_r = _sd_meta(a2a.sharded_state_dict()), _sd_meta(ring.sharded_state_dict())
    assert meta_a == meta_r, f"sharded_state_dict differs: {meta_a} vs {meta_r}"

    # a distributed-checkpoint round trip by (key, global offset) of every ShardedTensor, as
    # megatron's dist_checkpointing does (its savers call CUDA unconditionally, so the real
    # save/load runs in tests/gpu/test_e2e_gpu.py): alltoall -> ring -> alltoall
    saved = shard_save(a2a)
    fresh_ring = build_layer(make_config("ring", world, **kw), pgs)
    shard_load(fresh_ring, saved)
    for k, v in fresh_ring.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, sd_a[k]), f"checkpoint alltoall->ring: {k} differs"
    torch.manual_seed(99)  # same draws on every rank: replicated params stay replicas
    with torch.no_grad():
        for p in fresh_ring.parameters():
            p.add_(torch.randn_like(p))
    saved = shard_save(fresh_ring)
    fresh_a2a = build_layer(make_config("alltoall", world, **kw), pgs)
    shard_load(fresh_a2a, saved)
    sd_r = fresh_ring.state_dict()
    for k, v in fresh_a2a.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, sd_r[k]), f"checkpoint ring->alltoall: {k} differs"


def _shards(layer):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = layer.sharded_state_dict()
    apply_factories(sd)  # e.g. the SwiGLU fc1 factory: gate and up halves as separate shards
    return [v for v in nested_values(sd) if isinstance(v, ShardedTensor)]


def shard_save(layer) -> dict:
    local = {(sh.key, tuple(sh.global_offset)): sh.data.detach().clone() for sh in _shards(layer)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    merged = {}
    for d in everyone:
        for k, v in d.items():
            if k in merged:  # a replicated shard (router, shared experts) must agree
                assert torch.equal(merged[k], v), f"replicas of {k} differ"
            merged[k] = v
    return merged


@torch.no_grad()
def shard_load(layer, saved: dict) -> None:
    for sh in _shards(layer):
        src = saved[(sh.key, tuple(sh.global_offset))]
        assert src.shape == sh.data.shape, f"{sh.key}: {src.shape} vs {sh.data.shape}"
        sh.data.copy_(src)


CASES = [
    dict(name="top2+shared", seed=1, config=dict(moe_shared_expert_intermediate_size=12)),
    dict(
        name="top1-sigmoid",
        seed=2,
        config=dict(moe_router_topk=1, moe_router_score_function="sigmoid"),
    ),
    dict(name="topK=E+ddp-layout", seed=3, layout="ddp", config=dict(moe_router_topk=8)),
    dict(
        name="skewed(empty experts)+reversed-layout",
        seed=4,
        skew=True,
        layout="reversed",
        config=dict(moe_router_topk=2),
    ),
    dict(
        name="recompute-moe+shared",  # Megatron's checkpoint replays router and ring in backward
        seed=6,
        config=dict(
            recompute_granularity="selective",
            recompute_modules=["moe"],
            moe_shared_expert_intermediate_size=12,
        ),
    ),
    dict(
        name="pre-softmax+group-topk+scale",
        seed=5,
        config=dict(
            moe_router_topk=2,
            moe_router_pre_softmax=True,
            moe_router_num_groups=4,
            moe_router_group_topk=2,
            moe_router_topk_scaling_factor=2.5,
        ),
    ),
]


# Router losses and expert bias act on the router's own tokens: a ring rank sees its tokens, the
# reference (one layer, the union of every rank's tokens) sees them all, so at EP > 1 the two
# losses differ by design. At EP = 1 the tokens are the same, and these cases show that the
# losses' gradients reach the router through the ring dispatcher exactly as through allgather.
CASES_EP1 = [
    dict(
        name="aux-loss+z-loss",
        seed=11,
        config=dict(
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1
        ),
    ),
    dict(
        name="seq-aux-loss",
        seed=12,
        config=dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.5),
    ),
    dict(
        name="global-aux-loss",
        seed=13,
        config=dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.5),
    ),
    dict(
        name="expert-bias+sigmoid+fp32-router",
        seed=14,
        config=dict(
            moe_router_enable_expert_bias=True,
            moe_router_score_function="sigmoid",
            moe_router_dtype="fp32",
        ),
    ),
]


def _worker(rank, world, impl):
    _init(rank, world)
    with ring_impl(impl):
        for case in CASES + (CASES_EP1 if world == 1 else []):
            run_equivalence(rank, world, case, real=impl == "ring")
        if impl == "standin":  # the checkpoint layout does not depend on the ring
            assert STANDIN_CALLS[0] > 0, "the dispatcher never called the patched stand-in"
            run_checkpoint_interchange(rank, world)
    _done()


def _worker_tp(rank, world, tp):
    _init(rank, world, tp=tp)
    for case in CASES[1:4]:  # no shared experts: theirs are TP-sharded, the reference's not
        run_equivalence(rank, world, case, tp=tp)
    _done()


def _worker_cp(rank, world, cp):
    _init(rank, world, cp=cp)
    for case in CASES[:4]:
        run_equivalence(rank, world, case, cp=cp)
    _done()


def run_two_dispatchers(rank, world) -> None:
    """Two ring layers with different options in one process each run as their own: their
    configs (attached to their TransformerConfigs, ``relaymoe.megatron.configure``) reach their
    calls, building the second changes nothing of the first, and each keeps its agreements in
    its own runtime (a trusted call's second step agrees in neither). Both compute the same
    layer: their outputs agree."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    import relaymoe.ring.engine as engine
    from relaymoe.megatron import configure
    from relaymoe.options import RingConfig

    configs = {"token": RingConfig(mode="token", overlap=False),
               "expert": RingConfig(mode="expert", host_wait="pass")}  # fmt: skip
    layers = {}
    for mode, ring_config in configs.items():
        cfg = configure(make_config("ring", world), ring=ring_config)
        layers[mode] = build_layer(cfg, ProcessGroupCollection.use_mpu_process_groups())
    w = global_weights(make_config("ring", world), seed=5)
    el = make_config("ring", world).num_moe_experts // world
    for layer in layers.values():
        load_weights(layer, w, rank * el, el)
        layer.train()
    disp = {m: layer.token_dispatcher for m, layer in layers.items()}
    assert disp["token"].ring_config is configs["token"]  # building the second changed nothing
    assert disp["expert"].ring_config is configs["expert"]
    # what their calls pass: the config itself (no --relaymoe-gpus-per-node to count in EP ranks)
    assert all(d.call_config is d.ring_config for d in disp.values())
    assert disp["token"].runtime is not disp["expert"].runtime
    # the layers of one model (one TransformerConfig) share its runtime: one workspace, one
    # agreement of equal shapes (relaymoe.megatron.dispatcher.model_runtime)
    twin = build_layer(layers["token"].config, ProcessGroupCollection.use_mpu_process_groups())
    assert twin.token_dispatcher.runtime is disp["token"].runtime

    seen = []
    real_agree, real_apply = engine.agree, engine._RingMoE.apply

    def agree(*args, runtime, **kw):
        problem = real_agree(*args, runtime=runtime, **kw)
        seen.append(("agree", runtime, problem.mode))
        return problem

    def apply(*args):
        seen.append(("call", args[4].runtime, (args[4].overlap, args[4].host_wait)))
        return real_apply(*args)

    g = torch.Generator().manual_seed(6)
    x = torch.randn(4 + rank, B, H, generator=g)
    dy = torch.randn(4 + rank, B, H, generator=g)
    outs = {}
    with (
        mock.patch.object(engine, "agree", agree),
        mock.patch.object(engine._RingMoE, "apply", apply),
    ):
        for _step in range(2):
            for mode, layer in layers.items():
                xi = x.clone().requires_grad_(True)
                out, _ = layer(xi)
                (out * dy).sum().backward()
                outs[mode] = out.detach()
    for mode, d in disp.items():
        mine = [(kind, what) for kind, rt, what in seen if rt is d.runtime]
        assert ("agree", mode) in mine and all(w == mode for k, w in mine if k == "agree"), mine
        want = (configs[mode].overlap, configs[mode].host_wait)
        assert [w for k, w in mine if k == "call"] == [want, want], mine
        # trusted calls of one signature: one agreement each, in its own runtime only
        assert [p.mode for p in d.runtime.agreements.values()] == [mode], d.runtime
    check_close(f"[two dispatchers rank={rank}] token vs expert", outs["token"], outs["expert"])


def two_dispatchers(rank, world, group):
    _init(rank, world)
    run_two_dispatchers(rank, world)
    _done()


# The scenarios (``fn(rank, world, group)``) run in one spawned world per size for the file
# (``gloo_worlds``): each rank imports Megatron once, not once per test.
def standin(rank, world, group):
    _worker(rank, world, "standin")


def ring(rank, world, group):
    _worker(rank, world, "ring")


def tp2_sequence_parallel(rank, world, group):
    _worker_tp(rank, world, 2)


def cp2(rank, world, group):
    _worker_cp(rank, world, 2)


def _params(sizes):
    """Each test's items: one per world size, grouped with the other tests' items of that size
    (one worker, one world, under pytest-xdist ``--dist loadgroup``)."""
    return [pytest.param(size, id=str(size), marks=pytest.mark.xdist_group(f"{__name__}-w{size}"))
            for size in sizes]  # fmt: skip


@pytest.mark.parametrize("world", _params([1, 2, 4]))
def test_integration_with_standin_ring_and_checkpoint_interchange(world, gloo_worlds):
    """The Megatron integration itself, isolated from the ring engine by the stand-in."""
    gloo_worlds.run(standin, world, timeout=420)


@pytest.mark.parametrize("world", _params([1, 2, 4]))
def test_ring_moelayer_matches_allgather(world, gloo_worlds):
    """End to end: the MoELayer with relaymoe.ring.ring_moe (mode auto) vs allgather."""
    gloo_worlds.run(ring, world, timeout=420)


@pytest.mark.parametrize("world", _params([4]))
def test_ring_moelayer_with_tensor_and_sequence_parallel(world, gloo_worlds):
    """TP = 2 with sequence parallelism and EP = 2 (world 4, expert data parallel 2): each rank
    routes its own sequence shard through the ring; the same expert on two ranks gets the sum."""
    gloo_worlds.run(tp2_sequence_parallel, world, timeout=420)


@pytest.mark.parametrize("world", _params([2, 4]))
def test_ring_moelayer_with_context_parallel(world, gloo_worlds):
    """CP = 2 (world 2: EP = 2 over the two CP ranks; world 4: DP 2 x CP 2, EP = 4): each rank
    holds its own chunk of the sequence, and the ring serves every chunk as allgather does."""
    gloo_worlds.run(cp2, world, timeout=420)


@pytest.mark.parametrize("world", _params([1, 2]))
def test_two_dispatchers_with_different_options_each_run_as_their_own(world, gloo_worlds):
    gloo_worlds.run(two_dispatchers, world, timeout=420)


def test_model_runtime_is_the_models_one_per_group_and_options():
    """``model_runtime``: one runtime per (EP group, ring config) on a model's config; a copy of
    the config shares them, a pickled one carries none, another config has its own."""
    import copy
    import pickle
    import types

    from relaymoe.megatron.dispatcher import CONFIG_RUNTIMES, ModelRuntimes, model_runtime
    from relaymoe.options import RingConfig

    cfg, other = types.SimpleNamespace(), types.SimpleNamespace()
    a = model_runtime(cfg, None, RingConfig())
    assert model_runtime(cfg, None, RingConfig()) is a  # equal options: the same runtime
    assert model_runtime(cfg, None, RingConfig(mode="token")) is not a
    assert model_runtime(other, None, RingConfig()) is not a
    assert model_runtime(copy.deepcopy(cfg), None, RingConfig()) is a
    held = getattr(cfg, CONFIG_RUNTIMES)
    assert isinstance(held, ModelRuntimes) and len(held) == 2
    assert pickle.loads(pickle.dumps(held)) == {}
