"""ring_moe over spawned gloo process groups (world sizes 1-4) against the float64 oracle.

Each world is spawned once and runs many checks (spawning is the slow part). Every rank builds
the same global problem from a shared seed, runs ring_moe on its slice, and compares its slice
of the output and of every gradient (x, topk_probs, and its own experts' w13/w2) with the
oracle applied to the whole problem.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from relaymoe.activation import SWIGLU, ExpertActivation
from relaymoe.options import RingConfig
from relaymoe.reference import moe_experts_reference
from tests.fixtures import expert_activation, ring_problem, scenario_params

pytestmark = pytest.mark.slow

H, I = 24, 12
# The widths of the cases on the Triton hop kernels: one partial tile each (the interpreter's
# tiles are 16 wide; its time grows with their count), rows of 16-byte multiples in fp32 (the
# gathered-copy GEMMs' descriptors need them). What the ring adds to the kernels (expert ranges,
# accumulation over hops, pair buffers) does not depend on the width; the kernels' tile edges
# are tested in tests/lib/test_kernels.py.
TRITON_H, TRITON_I = 12, 4


# ---------------------------------------------------------------------------------------------
# the global problem and the oracle
# ---------------------------------------------------------------------------------------------
def _problem(seed, tokens, El, K, world, route="uniform", act=None, bias="none", hidden=H, ffn=I):
    """The global problem; ``act`` (an ``EXPERT_ACTIVATIONS`` key, None: SwiGLU) keeps w13's
    first J rows (scaled by a clamp limit, so that many pre-activations are clamped), ``bias``
    (``tests.fixtures.BIASES``) adds ``b13 (E, J)`` / ``b2 (E, H)``."""
    pb = ring_problem(seed, tokens, El * world, K, hidden, ffn, route=route)
    act = SWIGLU if act is None else expert_activation(act)
    pb["act"], J, E = act, act.fc1_rows(ffn), El * world
    pb["w13"] = pb["w13"][:, :J].contiguous() * (act.limit or 1.0)
    g = torch.Generator().manual_seed(seed + 7919)
    b13 = 0.5 * torch.randn(E, J, generator=g, dtype=torch.float64)
    b2 = 0.5 * torch.randn(E, hidden, generator=g, dtype=torch.float64)
    pb["b13"] = b13 if bias in ("b13", "both") else None
    pb["b2"] = b2 if bias in ("b2", "both") else None
    return pb


def _oracle(pb):
    names = ("x", "w13", "w2", "probs", "b13", "b2")
    leaves = {k: pb[k].clone().requires_grad_() for k in names if pb.get(k) is not None}
    out = moe_experts_reference(
        leaves["x"], leaves["w13"], leaves["w2"], pb["idx"], leaves["probs"],
        activation=pb.get("act"), b13=leaves.get("b13"), b2=leaves.get("b2"),
    )  # fmt: skip
    if not out.requires_grad:  # no tokens at all: the oracle built no graph
        return out.detach(), {k: torch.zeros_like(v) for k, v in leaves.items()}
    out.backward(pb["dy"])
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _rel(a, b):
    a, b = a.double(), b.double()
    if b.numel() == 0:
        return 0.0
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


# The forms of this rank's expert weights ring_moe accepts (see relaymoe/ring/weights.py):
# "tensor" (El, 2I, H) / (El, H, I); lists of per-expert leaf parameters: "separate" (own
# storages), and views of one flat buffer as Megatron's DDP makes them (``param.data = view``):
# "forward" (fc1s back to back in expert order, then fc2s), "reversed" (the reverse: the DDP
# buffer of TEGroupedMLP, which holds parameters in reverse registration order) and
# "interleaved" (SequentialMLP under DDP: e[El-1].fc2, e[El-1].fc1, e[El-2].fc2, ...).
FORMS = ("tensor", "separate", "forward", "reversed", "interleaved")


def _weights(w13, w2, form):
    """``(w13_arg, w2_arg, per_expert_leaves)``: what to pass to ring_moe and the leaves whose
    ``.grad`` hold the gradient (per expert: ``[(fc1, fc2), ...]``; tensor form: one pair)."""
    El = w13.shape[0]
    if form == "tensor":
        a, b = w13.clone().requires_grad_(), w2.clone().requires_grad_()
        return a, b, [(a, b)]
    fc1 = [torch.nn.Parameter(w13[j].clone()) for j in range(El)]
    fc2 = [torch.nn.Parameter(w2[j].clone()) for j in range(El)]
    if form != "separate":
        registered = [p for j in range(El) for p in (fc1[j], fc2[j])]  # SequentialMLP order
        if form in ("forward", "reversed"):
            registered = fc1 + fc2  # TEGroupedMLP order: weight0..weight{El-1} of fc1, then fc2
        buf_order = registered[::-1] if form in ("reversed", "interleaved") else registered
        buf = torch.full((sum(q.numel() for q in buf_order),), float("nan"), dtype=w13.dtype)
        at = 0
        with torch.no_grad():
            for q in buf_order:  # what DDP's _ParamAndGradBuffer does: param.data = buffer view
                view = buf[at : at + q.numel()].view(q.shape)
                view.copy_(q.data)
                q.data = view
                at += q.numel()
    return fc1, fc2, list(zip(fc1, fc2, strict=True))


def _biases(b, form):
    """``(argument, leaves)`` of this rank's bias ``b (El, n)`` (None: ``(None, [])``) in the
    weights' ``form``: a leaf tensor, or per-expert parameters (``reversed``: views of one
    buffer in reverse expert order, as Megatron's DDP buffer holds TE's bias0..bias{El-1};
    otherwise separate storages)."""
    if b is None:
        return None, []
    if form == "tensor":
        leaf = b.clone().requires_grad_()
        return leaf, [leaf]
    ps = [torch.nn.Parameter(b[j].clone()) for j in range(b.shape[0])]
    if form == "reversed":
        buf = b.flip(0).reshape(-1).clone()
        for j, q in enumerate(ps):
            at = (b.shape[0] - 1 - j) * b.shape[1]
            q.data = buf[at : at + b.shape[1]]
    return ps, ps


def _bias_grad(leaves):
    if len(leaves) == 1 and leaves[0].dim() == 2:
        return leaves[0].grad
    assert all(q.grad is not None for q in leaves), "a bias element got no gradient"
    return torch.stack([q.grad for q in leaves])


def _stacked_grads(leaves):
    if len(leaves) == 1 and leaves[0][0].dim() == 3:
        return leaves[0][0].grad, leaves[0][1].grad
    for j, (a, b) in enumerate(leaves):
        assert a.grad is not None and b.grad is not None, f"expert {j} got no gradient"
        assert a.grad.shape == a.shape and b.grad.shape == b.shape
    return torch.stack([a.grad for a, _ in leaves]), torch.stack([b.grad for _, b in leaves])


def _run_case(rank, world, group, *, seed, tokens, El, K, dtype, prob_dtype=None, mode="expert",
              transport="auto", overlap=True, route="uniform", check_grads=True, form="tensor",
              tol=None, backend="auto", trusted=False, schedule="auto",
              gpus_per_node=None, act=None, bias="none", hidden=H, ffn=I, config=None,
              runtime=None):  # fmt: skip
    """ring_moe on this rank's slice vs the oracle; returns the ring's (out, grads). ``act``
    and ``bias``: the expert MLP (``_problem``; the biases' gradients are checked too);
    ``config``/``runtime``: ring_moe's, ``config`` (None: the defaults) with this helper's
    ``mode``, ``transport``, ``schedule``, ``gpus_per_node`` and ``overlap``."""
    from relaymoe.ring import ring_moe

    pb = _problem(seed, tokens, El, K, world, route, act, bias, hidden, ffn)
    ref_out, ref_g = _oracle(pb)
    lo, hi = sum(tokens[:rank]), sum(tokens[: rank + 1])
    e0, e1 = rank * El, (rank + 1) * El
    pdt = prob_dtype or dtype
    x = pb["x"][lo:hi].to(dtype).requires_grad_()
    w13, w2, leaves = _weights(pb["w13"][e0:e1].to(dtype), pb["w2"][e0:e1].to(dtype), form)
    probs = pb["probs"][lo:hi].to(pdt).requires_grad_()
    idx = pb["idx"][lo:hi]
    biases = {n: _biases(None if pb[n] is None else pb[n][e0:e1].to(dtype), form)
              for n in ("b13", "b2")}  # fmt: skip
    mlp = {} if act is None and bias == "none" else {
        "activation": pb["act"], "b13": biases["b13"][0], "b2": biases["b2"][0]}  # fmt: skip
    # the ring options travel in the config, not as ring_moe keywords
    config = (config or RingConfig()).replace(
        mode=mode, transport=transport, schedule=schedule, gpus_per_node=gpus_per_node,
        **({} if overlap else {"overlap": False}),
    )  # fmt: skip
    out = ring_moe(
        x,
        w13,
        w2,
        idx,
        probs,
        group=group,
        backend=backend,
        trusted=trusted,
        config=config,
        runtime=runtime,
        **mlp,
    )
    if tol is None:
        tol = 1e-11 if dtype == pdt == torch.float64 else 3e-5
    what = (f"mode={mode} dtype={dtype} tokens={tokens} El={El} K={K} route={route} form={form} "
            f"schedule={schedule} gpus_per_node={gpus_per_node} act={act} bias={bias} "
            f"rank={rank}")  # fmt: skip
    assert out.shape == (hi - lo, hidden) and out.dtype == dtype, what
    assert _rel(out, ref_out[lo:hi]) < tol, f"out {_rel(out, ref_out[lo:hi])} {what}"
    if not check_grads:
        return out.detach(), None
    out.backward(pb["dy"][lo:hi].to(dtype))
    w13_grad, w2_grad = _stacked_grads(leaves)
    pairs = [
        ("dx", x.grad, ref_g["x"][lo:hi]),
        ("dprobs", probs.grad, ref_g["probs"][lo:hi]),
        ("dw13", w13_grad, ref_g["w13"][e0:e1]),
        ("dw2", w2_grad, ref_g["w2"][e0:e1]),
    ]
    pairs += [(f"d{n}", _bias_grad(biases[n][1]), ref_g[n][e0:e1])
              for n in ("b13", "b2") if pb[n] is not None]  # fmt: skip
    for name, got, ref in pairs:
        assert got is not None and got.shape == ref.shape, f"{name} missing {what}"
        assert _rel(got, ref) < tol, f"{name} {_rel(got, ref)} {what}"
    # experts no token picked get exactly zero gradient
    used = torch.zeros(El * world, dtype=torch.bool)
    used[pb["idx"].reshape(-1)] = True
    for j in range(El):
        if not used[e0 + j]:
            assert torch.all(w13_grad[j] == 0) and torch.all(w2_grad[j] == 0), what
            for _, got, _ in pairs[4:]:  # the biases'
                assert torch.all(got[j] == 0), what
    return out.detach(), (x.grad, probs.grad, w13_grad, w2_grad)


# ---------------------------------------------------------------------------------------------
# scenarios (run on every rank of a spawned world)
# ---------------------------------------------------------------------------------------------
def _correctness(rank, world, group):
    R = world
    uneven = [5, 0, 9, 3][:R] if R > 1 else [7]
    cases = []
    for mode in ("expert", "token", "alltoall", "auto"):
        cases.append(dict(mode=mode, seed=1, tokens=uneven, El=2, K=2, dtype=torch.float64))
    # a trusted caller: cached agreement, pair buffers from the bound (_trusted_steady_state
    # covers the ring modes' cache hits)
    cases.append(dict(mode="alltoall", seed=9, tokens=uneven, El=2, K=2, dtype=torch.float64,
                      trusted=True))  # fmt: skip
    cases += [
        dict(mode="expert", seed=2, tokens=[6] * R, El=3, K=3, dtype=torch.float32,
             prob_dtype=torch.float32, overlap=False),
        dict(mode="token", seed=3, tokens=[4, 7, 1, 2][:R], El=1, K=1, dtype=torch.float32,
             overlap=False),
        # K = E: every token visits every expert
        dict(mode="token", seed=4, tokens=[3, 2, 4, 1][:R], El=2, K=2 * R, dtype=torch.float64),
        dict(mode="expert", seed=4, tokens=[3, 2, 4, 1][:R], El=2, K=2 * R, dtype=torch.float64),
        # all tokens to one expert; skewed routing leaves experts empty
        dict(mode="expert", seed=5, tokens=[4] * R, El=2, K=1, dtype=torch.float64, route="one"),
        dict(mode="token", seed=5, tokens=[4] * R, El=2, K=2, dtype=torch.float64, route="one"),
        dict(mode="token", seed=6, tokens=[5, 3, 0, 6][:R], El=3, K=2, dtype=torch.float64,
             route="skew"),
        dict(mode="expert", seed=6, tokens=[0, 3, 0, 6][:R], El=3, K=2, dtype=torch.float64,
             route="skew"),
        # fp32 probabilities with fp64 activations
        dict(mode="token", seed=7, tokens=[2, 5, 3, 3][:R], El=2, K=2, dtype=torch.float64,
             prob_dtype=torch.float32),
        # the all-to-all mode: top-1, K = E, skewed routing, empty experts, fp32 probabilities
        dict(mode="alltoall", seed=3, tokens=[4, 7, 1, 2][:R], El=1, K=1, dtype=torch.float32),
        dict(mode="alltoall", seed=4, tokens=[3, 2, 4, 1][:R], El=2, K=2 * R, dtype=torch.float64),
        dict(mode="alltoall", seed=5, tokens=[4] * R, El=2, K=1, dtype=torch.float64, route="one"),
        dict(mode="alltoall", seed=6, tokens=[5, 3, 0, 6][:R], El=3, K=2, dtype=torch.float64,
             route="skew"),
        dict(mode="alltoall", seed=7, tokens=[2, 5, 3, 3][:R], El=2, K=2, dtype=torch.float64,
             prob_dtype=torch.float32),
    ]  # fmt: skip
    if R > 1:  # every rank but the last has no tokens
        for mode in ("token", "alltoall"):
            cases.append(dict(mode=mode, seed=8, tokens=[0] * (R - 1) + [5], El=1, K=1,
                              dtype=torch.float64))  # fmt: skip
    for c in cases:
        _run_case(rank, world, group, **c)


# The expert MLPs the ring scenarios cover: GeGLU (gated), squared ReLU (not gated: J = I),
# GPT-OSS's clamped SwiGLU (alpha, clamp, offset); each without biases, with both, with b13 only
RING_ACTIVATIONS = ("geglu", "squared_relu", "clamped_swiglu")
RING_BIASES = ("none", "both", "b13")


def _activations(rank, world, group):
    """Activations x biases in every mode (the torch hops, float64) against the oracle:
    forward and the gradients of x, w13, w2, probs, b13, b2 (expert mode: the biases travel
    with their weights and their gradients come home with the weight gradients; token and
    all-to-all modes: they stay). Uneven T with a zero-token rank; list form (biases as
    per-expert parameters) in every mode; a trusted call; the agreed problem."""
    from relaymoe.ring import resolved_problem

    R = world
    uneven = [5, 0, 9, 3][:R] if R > 1 else [7]
    base = dict(tokens=uneven, El=2, K=2, dtype=torch.float64, backend="torch")
    # a Latin square: every mode meets every activation and every bias set, and every
    # (activation, biases) pair runs in one mode
    for m, mode in enumerate(("expert", "token", "alltoall")):
        for n, act in enumerate(RING_ACTIVATIONS):
            bias = RING_BIASES[(m + n) % len(RING_BIASES)]
            _run_case(rank, world, group, seed=70 + 3 * m + n, mode=mode, act=act, bias=bias,
                      **base)  # fmt: skip
    for mode in ("expert", "token", "alltoall"):  # list form: separate, and DDP-reversed views
        for form, act in (("separate", "squared_relu"), ("reversed", "clamped_swiglu")):
            _run_case(rank, world, group, seed=80, mode=mode, act=act, bias="both", form=form,
                      route="skew", **base)  # fmt: skip
    _run_case(rank, world, group, seed=81, mode="expert", act="geglu", bias="both",
              trusted=True, overlap=False, **{**base, "dtype": torch.float32})  # fmt: skip
    pb = _problem(82, [3] * R, 2, 2, R, act="squared_relu", bias="b13")
    lo, e0 = 3 * rank, 2 * rank
    problem = resolved_problem(
        pb["x"][lo : lo + 3], pb["w13"][e0 : e0 + 2], pb["w2"][e0 : e0 + 2],
        pb["idx"][lo : lo + 3], pb["probs"][lo : lo + 3], group=group,
        activation="squared_relu", b13=pb["b13"][e0 : e0 + 2],
    )  # fmt: skip
    got = (problem.activation, problem.fc1_rows, problem.has_b13, problem.has_b2)
    assert got == (pb["act"], I, True, False)


def _triton_backend(rank, world, group):
    """The fused Triton hop kernels inside the ring (interpreter on CPU), partial expert ranges
    sized from the pass's one read of the partition bounds; uneven tokens, an empty rank."""
    from relaymoe.kernels import triton_available

    if world not in (2, 3) or not triton_available():
        return  # two world sizes cover the multi-hop paths; the interpreter is slow
    tokens = [5, 0, 7][:world]
    kw = dict(El=2, K=2, dtype=torch.float32, backend="triton", tol=1e-4, hidden=TRITON_H,
              ffn=TRITON_I)  # fmt: skip
    for mode in ("expert", "token", "alltoall"):
        _run_case(rank, world, group, mode=mode, seed=11, tokens=tokens, **kw)
    if world != 3:
        return
    # a trusted caller: pair buffers sized from the bound (rows past the count never read),
    # then exact counts per call once the bound is over the budget, then the gathered-copy row
    # GEMMs over bound-sized buffers; in the world of 3, where one pass's buffers serve two
    # visiting partitions (of 0 and of 7 or 5 tokens) after the rank's own
    for var, value in (("RELAYMOE_PAIR_BUFFER_MIB", "512"), ("RELAYMOE_PAIR_BUFFER_MIB", "0"),
                       ("RELAYMOE_ROWS_GATHER", "copy")):  # fmt: skip
        with _ring_env(var, value) as config:
            for mode in ("expert", "token"):
                _run_case(rank, world, group, mode=mode, seed=12, tokens=tokens, trusted=True,
                          route="skew", config=config, **kw)  # fmt: skip


@contextlib.contextmanager
def _hop_slices(rows: int):
    """Every hop computes in slices of ``rows`` pairs (``KernelOptions.hop_slice_mib``'s slices,
    made a few pairs long: a real budget's slice holds hundreds of thousands)."""
    from relaymoe.kernels import experts, select

    real_rows, real_slices = select.hop_slice_rows, experts.pair_slices
    seen: list[int] = []

    def counted(*a):
        out = real_slices(*a)
        seen.append(len(out))
        return out

    select.hop_slice_rows = lambda *a, **kw: rows
    experts.pair_slices = counted
    try:
        yield seen
    finally:
        select.hop_slice_rows, experts.pair_slices = real_rows, real_slices


def _sliced_hops(rank, world, group):
    """The Triton hops sliced a few pairs at a time inside the ring, both ring modes: a world of
    one slices its one call, a ring each hop's range (untrusted: exact pair counts; trusted: buffers
    and slices from the bound, the slices past the count empty); uneven tokens, an empty rank,
    skewed routing."""
    from relaymoe.kernels import triton_available

    if not triton_available():
        return
    tokens = [6, 0, 7, 3][:world] if world > 1 else [9]
    kw = dict(El=2, K=2, dtype=torch.float32, backend="triton", tol=1e-4, hidden=TRITON_H,
              ffn=TRITON_I, tokens=tokens, route="skew")  # fmt: skip
    # a world of one runs one local call whatever the mode; the all-to-all mode's owner call
    # is token mode's hop primitive over its received rows
    with _hop_slices(4) as seen:
        for mode in ("expert", "token") if world > 1 else ("expert",):
            _run_case(rank, world, group, mode=mode, seed=13, **kw)
        _run_case(rank, world, group, mode="expert", seed=14, trusted=True, **kw)
    assert max(seen) >= 2, seen  # the hops did slice


@contextlib.contextmanager
def _ring_env(var: str, value: str):
    """``var=value`` for the ring: set, and read into the ``RingConfig`` the block gets, as an
    entry point reads the environment once (``relaymoe.options.from_env``); then unset."""
    from relaymoe import options

    old = os.environ.get(var)
    os.environ[var] = value
    try:
        yield options.from_env()
    finally:
        if old is None:
            del os.environ[var]
        else:
            os.environ[var] = old


def _list_forms(rank, world, group):
    """Per-expert lists in every layout: oracle-exact, equal to the tensor form (bitwise where
    the rows are used in expert order), in every mode, also when ranks mix forms."""
    for mode in ("expert", "token", "alltoall"):
        kw = dict(seed=51, tokens=[5, 0, 7, 3][:world], El=3, K=2, dtype=torch.float64,
                  mode=mode, route="skew")  # fmt: skip
        base_out, base_g = _run_case(rank, world, group, form="tensor", **kw)
        for form in FORMS[1:]:
            out, g = _run_case(rank, world, group, form=form, **kw)
            # reversed rows (token mode, or a world of one) change the summation order only
            exact = mode == "expert" and world > 1 or form != "reversed"
            for name, u, v in zip(("out", "dx", "dprobs", "dw13", "dw2"), (out, *g),
                                  (base_out, *base_g), strict=True):  # fmt: skip
                if exact:
                    assert torch.equal(u, v), f"{mode} {form} {name} differs from the tensor form"
                else:
                    assert _rel(u, v) < 1e-13, f"{mode} {form} {name} {_rel(u, v)}"
        # ranks mixing forms, fp32, overlap off
        form = FORMS[rank % len(FORMS)] if world > 1 else "reversed"
        _run_case(rank, world, group, seed=52, tokens=[4, 6, 2, 5][:world], El=2,
                  K=min(3, 2 * world), dtype=torch.float32, mode=mode, overlap=False,
                  form=form)  # fmt: skip
    # El = 1 and K = E in list form
    for mode in ("expert", "token"):
        _run_case(rank, world, group, seed=53, tokens=[3] * world, El=1, K=world,
                  dtype=torch.float64, mode=mode, form="reversed")  # fmt: skip


def saved_weight_copies(fn, args, kwargs, params, el_numels):
    """Run ``fn(*args, **kwargs)`` recording the tensors autograd saves; return (output, the
    saved tensors of one of ``el_numels`` elements (a stacked (El, ...) weight) whose storage
    is no parameter's, all saved tensors)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    param_storages = {q.untyped_storage().data_ptr() for q in params}
    copies = [
        t for t in saved
        if t.numel() in el_numels and t.untyped_storage().data_ptr() not in param_storages
    ]  # fmt: skip
    return out, copies, saved


def _no_persistent_copy(rank, world, group):
    """List form: nothing the size of a stacked weight is saved for backward except the
    parameters' own storage; the tensor form of a stacked copy is caught (the check can fail)."""
    from relaymoe.ring import ring_moe

    El, T = 2, 4
    pb = _problem(61, [T] * world, El, 2, world)
    w13, w2 = pb["w13"][rank * El : (rank + 1) * El], pb["w2"][rank * El : (rank + 1) * El]
    x = pb["x"][rank * T : (rank + 1) * T].clone().requires_grad_()
    probs = pb["probs"][rank * T : (rank + 1) * T].clone().requires_grad_()
    idx = pb["idx"][rank * T : (rank + 1) * T]
    sizes = {w13.numel(), w2.numel()}
    budget = x.numel() + 2 * probs.numel() + w13.numel() + w2.numel()  # x, probs, ids, params
    for mode in ("expert", "token"):
        kw = dict(group=group, config=RingConfig(mode=mode))
        for form in FORMS[1:]:
            fc1, fc2, _ = _weights(w13, w2, form)
            out, copies, saved = saved_weight_copies(
                ring_moe, (x, fc1, fc2, idx, probs), kw, fc1 + fc2, sizes
            )
            assert not copies, f"{mode} {form}: a stacked copy is saved for backward"
            assert sum(t.numel() for t in saved) <= budget, f"{mode} {form}: more saved"
            out.backward(torch.ones_like(out))
            assert all(q.grad is not None for q in fc1 + fc2)
        # the old adapter's path: a stack of the parameters passed in tensor form is saved
        fc1, fc2, _ = _weights(w13, w2, "separate")
        args = (x, torch.stack(fc1), torch.stack(fc2), idx, probs)
        out, copies, _ = saved_weight_copies(ring_moe, args, kw, fc1 + fc2, sizes)
        assert len(copies) == 2, f"{mode}: the check misses a saved stacked copy"
        out.backward(torch.ones_like(out))


def _determinism(rank, world, group):
    for mode in ("expert", "token", "alltoall"):
        kw = dict(seed=11, tokens=[5, 4, 6, 2][:world], El=2, K=2, dtype=torch.float32, mode=mode)
        a_out, a_g = _run_case(rank, world, group, **kw)
        b_out, b_g = _run_case(rank, world, group, **kw)
        assert torch.equal(a_out, b_out), f"{mode} forward not bitwise reproducible"
        for u, v in zip(a_g, b_g, strict=True):
            assert torch.equal(u, v), f"{mode} gradient not bitwise reproducible"


def _modes_agree_and_auto(rank, world, group):
    """``mode="auto"`` resolves to what ``relaymoe plan`` sizes memory for (the planner's
    ``ring_mode`` on the same per-GPU shapes), over a grid of shapes, on every rank alike.
    Inputs are zero-stride expansions: the agreement reads shapes, not values."""
    from relaymoe.planner import ring_mode
    from relaymoe.planner.memory import PROB_BYTES, Shapes
    from relaymoe.ring import resolved_problem

    pdtype = {4: torch.float32, 2: torch.bfloat16}[PROB_BYTES]
    seen = set()
    for T in (1024, 4096, 16384, 65536):
        for h, ffn, El, K in ((2048, 768, 8, 8), (1024, 4096, 2, 2), (4096, 1536, 4, 4)):
            x = torch.zeros((), dtype=torch.bfloat16).expand(T, h)
            w13 = torch.zeros((), dtype=torch.bfloat16).expand(El, 2 * ffn, h)
            w2 = torch.zeros((), dtype=torch.bfloat16).expand(El, h, ffn)
            idx = (torch.arange(T * K) % (El * world)).view(T, K)
            probs = torch.zeros((), dtype=pdtype).expand(T, K)
            problem = resolved_problem(x, w13, w2, idx, probs, group=group, trusted=True,
                                       config=RingConfig(transport="nccl"))  # fmt: skip
            sh = Shapes(b=1, s=T, h=h, tp=1, cp=1, T_a=T, T=T, K=K, E=El * world, El=El, I=ffn,
                        R=world, e=2)  # fmt: skip
            want = ring_mode(sh, "auto", transport="nccl")
            assert problem.mode == want, (T, h, ffn, El, K, world, problem.mode, want)
            seen.add(problem.mode)
    assert world == 1 or len(seen) > 1, f"the grid exercises one mode only: {seen}"
    pb = _problem(21, [4] * world, 2, 2, world)
    lo, hi = 4 * rank, 4 * rank + 4
    args = (pb["x"][lo:hi], pb["w13"][2 * rank : 2 * rank + 2], pb["w2"][2 * rank : 2 * rank + 2],
            pb["idx"][lo:hi], pb["probs"][lo:hi])  # fmt: skip
    problem = resolved_problem(*args, group=group)
    assert problem.transport == ("local" if world == 1 else "nccl")
    assert problem.tokens == (4,) * world


def _bad_inputs(rank, world, group):
    """Each bad input raises ValueError on EVERY rank, then the group still works."""
    from relaymoe.ring import ring_moe

    def inputs(T=3, El=2, h=H, i=I, K=2, dtype=torch.float32):
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(T, h, generator=g, dtype=dtype)
        w13 = torch.randn(El, 2 * i, h, generator=g, dtype=dtype)
        w2 = torch.randn(El, h, i, generator=g, dtype=dtype)
        idx = torch.rand(T, El * world, generator=g).argsort(1)[:, :K]
        probs = torch.rand(T, K, generator=g, dtype=dtype)
        return [x, w13, w2, idx, probs]

    last = world - 1
    good = inputs()

    def bad_range():
        a = inputs()
        if rank == last:
            a[3] = a[3].clone()
            a[3][0, 0] = 2 * world  # == E: out of range
        return a

    def bad_dtype():
        a = inputs()
        if rank == last:
            a[1] = a[1].double()
        return a

    cases = {
        "topk id out of range": (bad_range, {}, "expert id|outside|topk_idx"),
        "dtype mismatch": (bad_dtype, {}, "dtype"),
        "negative id": (
            lambda: [
                *inputs()[:3],
                torch.full((3, 2), -1) if rank == 0 else inputs()[3],
                inputs()[4],
            ],
            {},
            "topk_idx",
        ),  # fmt: skip
        "w13 list with a misshapen element": (
            lambda: (
                [good[0], list(good[1].unbind(0)), list(good[2].unbind(0)), *good[3:]]
                if rank != last
                else [good[0], [good[1][0], good[1][1, :, :-1]], list(good[2].unbind(0)), *good[3:]]
            ),
            {},
            "w13 list elements|not a tensor",
        ),
        "one form per call": (lambda: [good[0], list(good[1].unbind(0)), *good[2:]], {}, "both"),
    }
    # the expert MLP: bad values on one rank, the activation's rows, the biases' form and shape
    J, g2 = 2 * I, torch.zeros(2, H)
    cases["bad activation name"] = (inputs, {"activation": "swigl" if rank == last else None},
                                    "activation")  # fmt: skip
    cases["w13 rows against the activation"] = (
        inputs, {"activation": "gelu" if rank == last else None}, r"J=12|shapes")  # fmt: skip
    cases["b13 shape"] = (inputs, {"b13": torch.zeros(2, J + (rank == last))}, r"b13|shapes")
    cases["bias in another form"] = (
        inputs, {"b2": list(g2) if rank == last else g2}, "b2 must come in the weights' form|"
        "not a tensor")  # fmt: skip
    cases["bias dtype"] = (inputs, {"b2": g2.double() if rank == last else g2}, "dtype")
    if world > 1:
        # shapes consistent on every rank; the expert MLP differs: refused by name and value
        def gelu_rows(r):  # rank r computes non-gated GELU (fc1 of I rows), the others GeGLU
            a = inputs()
            if rank == r:
                a[1] = a[1][:, :I].contiguous()
            return a

        cases["activation differs"] = (
            inputs,
            {"activation": "geglu" if rank == last else "swiglu"},
            rf"expert activation differs across ranks \(rank 0: swiglu .*rank {last}: geglu",
        )
        cases["gated differs"] = (
            lambda: gelu_rows(last),
            {"activation": "gelu" if rank == last else "geglu"},
            rf"rank {last}: gelu = ExpertActivation\(fn='gelu', gated=False",
        )
        clamped = ExpertActivation(fn="silu", alpha=1.702, limit=7.0 + (rank == last),
                                   linear_offset=1.0)  # fmt: skip
        cases["clamp limit differs"] = (
            inputs,
            {"activation": clamped},
            rf"rank {last}: clamped_swiglu\(.*limit=8\.0",
        )
        cases["bias presence differs"] = (
            inputs,
            {"b2": g2 if rank == last else None},
            rf"expert biases differ across ranks \(rank 0: none, .*rank {last}: b2\)",
        )
        cases["E_local differs"] = (
            lambda: inputs(El=3 if rank == last else 2),
            {},
            "E_local|topk_idx",
        )
        cases["H differs"] = (lambda: inputs(h=H + 8 if rank == last else H), {}, "hidden")
        cases["I differs"] = (lambda: inputs(i=I + 4 if rank == last else I), {}, "FFN width")
        mode = "token" if rank == last else "expert"
        cases["mode differs"] = (inputs, {"config": RingConfig(mode=mode)}, "mode")
        cases["dtype differs"] = (
            lambda: inputs(dtype=torch.float64 if rank == last else torch.float32),
            {},
            "dtype",
        )
    cases["copy_engine on cpu"] = (inputs, {"config": RingConfig(transport="copy_engine")},
                                   "copy_engine" if world > 1 else None)  # fmt: skip
    import re

    # a bad option value never reaches a call: the config refuses it where it is made
    with pytest.raises(ValueError, match="RingConfig.mode='experts' is not one of"):
        RingConfig(mode="experts")
    for name, (make, kw, pattern) in cases.items():
        a = make()
        if pattern is None:  # a world of one has nothing to transfer: no error
            ring_moe(*a, group=group, **kw)
            continue
        try:
            ring_moe(*a, group=group, **kw)
        except ValueError as err:
            assert re.search(pattern, str(err)), f"{name}: {err}"
        else:
            raise AssertionError(f"{name}: no ValueError on rank {rank}")
    # the group is still usable and in step
    _run_case(rank, world, group, seed=31, tokens=[2] * world, El=1, K=1, dtype=torch.float64,
              mode="token")  # fmt: skip


def _backward_disagreement(rank, world, group):
    """One rank needs no backward: every rank raises instead of hanging in the backward."""
    from relaymoe.ring import ring_moe

    if world == 1:
        return
    x = torch.randn(2, H, requires_grad=rank == 0)
    w13, w2 = torch.randn(1, 2 * I, H), torch.randn(1, H, I)
    idx, probs = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    try:
        ring_moe(x, w13, w2, idx, probs, group=group)
    except ValueError as err:
        assert "backward" in str(err), err
    else:
        raise AssertionError("no ValueError when only some ranks need a backward")


def _microbatches_in_flight(rank, world, group):
    """Pipeline schedules keep several microbatches of one layer in flight: 1F1B runs F0 F1 B0
    F2 B1 B2 on every rank of a stage (and so of its EP group). Each microbatch's output and dx
    match the oracle, and the weight gradients accumulate (as Megatron's DDP buffers do) to the
    sum of the microbatches' gradients. Microbatch 1 gives the last rank no tokens."""
    for mode, form in (("expert", "interleaved"), ("token", "tensor")):
        _one_f_one_b(rank, world, group, mode, form)


def _one_f_one_b(rank, world, group, mode, form, El=2, K=2):
    from relaymoe.ring import ring_moe

    tokens = [[5, 3, 4, 2][:world], [4, 6, 1, 0][:world], [2, 0, 7, 3][:world]]
    if world == 1:
        tokens = [[6], [0], [5]]
    pbs = [_problem(60 + m, t, El, K, world) for m, t in enumerate(tokens)]
    for pb in pbs[1:]:  # one layer: the same weights for every microbatch
        pb["w13"], pb["w2"] = pbs[0]["w13"], pbs[0]["w2"]
    refs = [_oracle(pb) for pb in pbs]
    e0, e1 = rank * El, (rank + 1) * El
    w13, w2, leaves = _weights(pbs[0]["w13"][e0:e1], pbs[0]["w2"][e0:e1], form)
    live = {}
    for step in ("F0", "F1", "B0", "F2", "B1", "B2"):
        m = int(step[1])
        lo, hi = sum(tokens[m][:rank]), sum(tokens[m][: rank + 1])
        what = f"microbatch {m} mode={mode} form={form} rank={rank}"
        if step[0] == "F":
            x = pbs[m]["x"][lo:hi].clone().requires_grad_()
            probs = pbs[m]["probs"][lo:hi].clone().requires_grad_()
            out = ring_moe(x, w13, w2, pbs[m]["idx"][lo:hi], probs, group=group,
                           config=RingConfig(mode=mode))  # fmt: skip
            assert _rel(out, refs[m][0][lo:hi]) < 1e-11, f"out {what}"
            live[m] = (out, x, probs)
        else:
            out, x, probs = live.pop(m)
            out.backward(pbs[m]["dy"][lo:hi])
            assert _rel(x.grad, refs[m][1]["x"][lo:hi]) < 1e-11, f"dx {what}"
            assert _rel(probs.grad, refs[m][1]["probs"][lo:hi]) < 1e-11, f"dprobs {what}"
    w13_grad, w2_grad = _stacked_grads(leaves)
    dw13 = sum(r[1]["w13"][e0:e1] for r in refs)
    dw2 = sum(r[1]["w2"][e0:e1] for r in refs)
    assert _rel(w13_grad, dw13) < 1e-11, f"accumulated dw13 mode={mode} form={form}"
    assert _rel(w2_grad, dw2) < 1e-11, f"accumulated dw2 mode={mode} form={form}"


def _trusted_steady_state(rank, world, group):
    """A trusted caller's second call with the same signature and runtime agrees without
    communicating (the runtime's cache), a new signature or another runtime agrees again, a
    call without a runtime agrees every time, and ``agree="every_call"`` (RELAYMOE_RING_AGREE)
    turns the cache off; the results stay oracle-exact throughout."""
    import relaymoe.ring.agreement as agree_mod
    from relaymoe.ring import RingRuntime

    calls = []
    real = agree_mod.dist.all_reduce

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    agree_mod.dist.all_reduce = counting
    try:
        for mode in ("expert", "token"):
            kw = dict(seed=31, tokens=[3, 5, 0, 4][:world], El=2, K=2, dtype=torch.float64,
                      mode=mode, trusted=True, route="skew")  # fmt: skip
            one = 1 if world > 1 else 0
            runtime = RingRuntime(group)
            _run_case(rank, world, group, runtime=runtime, **kw)
            calls.clear()
            _run_case(rank, world, group, runtime=runtime, **kw)
            assert not calls, f"{mode}: a cached agreement still ran {len(calls)} all-reduce(s)"
            _run_case(rank, world, group, runtime=runtime,
                      **{**kw, "tokens": [2, 6, 1, 3][:world]})  # fmt: skip
            assert len(calls) == one, f"{mode}: new signature, {calls}"
            for other in (RingRuntime(group), None):  # another runtime's cache, or none
                calls.clear()
                _run_case(rank, world, group, runtime=other, **kw)
                assert len(calls) == one, f"{mode}: runtime {other}, {calls}"
            with _ring_env("RELAYMOE_RING_AGREE", "every_call") as config:
                for _ in range(2):
                    calls.clear()
                    _run_case(rank, world, group, runtime=runtime, config=config, **kw)
                    assert len(calls) == one, f"{mode}: every_call, {calls}"
    finally:
        agree_mod.dist.all_reduce = real


def _settings_must_agree(rank, world, group):
    """Issue #32: the options that decide collectives (``RingConfig.agree``,
    ``KernelOptions.pair_buffer_mib``; RELAYMOE_RING_AGREE, RELAYMOE_PAIR_BUFFER_MIB at the
    entry point) differ on rank 0: every rank raises the same ValueError naming the option and
    each rank's value, trusted or not, first call or later, never a hang; nothing is agreed
    under them. The options are read once, into the config the calls get: a later change of
    one rank's environment does not move that rank to other collectives than its peers'."""
    from relaymoe.ring import RingRuntime

    if world == 1:
        return  # a world of one has no collective to disagree on
    kw = dict(seed=61, tokens=[3, 0, 4, 2][:world], El=2, K=2, dtype=torch.float64,
              mode="expert", route="skew")  # fmt: skip
    settings = (("RELAYMOE_RING_AGREE", "RingConfig.agree", "every_call", "cached",
                 "'every_call'", "'cached'"),
                ("RELAYMOE_PAIR_BUFFER_MIB", "KernelOptions.pair_buffer_mib", "0", "512", "0",
                 "512"))  # fmt: skip
    runtime = RingRuntime(group)
    kw["runtime"] = runtime
    for var, name, first, others, shown0, shown1 in settings:
        with _ring_env(var, first if rank == 0 else others) as config:
            for trusted in (True, False, True):
                with pytest.raises(ValueError) as info:
                    _run_case(rank, world, group, trusted=trusted, config=config, **kw)
                msg = str(info.value)
                assert f"the option {name} ({var}) differs" in msg, msg
                assert f"rank 0: {shown0}" in msg and f"rank 1: {shown1}" in msg, msg
            assert not runtime.agreements  # no agreement under disagreeing settings
    _run_case(rank, world, group, trusted=True, **kw)  # agreed and cached
    os.environ["RELAYMOE_RING_AGREE"] = "every_call" if rank == 0 else "cached"
    os.environ["RELAYMOE_PAIR_BUFFER_MIB"] = "0" if rank == 0 else "512"
    try:  # not read again: the cached agreement and the same collectives on every rank
        _run_case(rank, world, group, trusted=True, **kw)
        _run_case(rank, world, group, trusted=False, **kw)
    finally:
        del os.environ["RELAYMOE_RING_AGREE"], os.environ["RELAYMOE_PAIR_BUFFER_MIB"]


SCENARIOS = [_correctness, _activations, _triton_backend, _sliced_hops, _list_forms,
             _no_persistent_copy,
             _determinism, _modes_agree_and_auto, _bad_inputs, _backward_disagreement,
             _microbatches_in_flight, _trusted_steady_state, _settings_must_agree]  # fmt: skip


@pytest.mark.parametrize(("world", "scenario"), scenario_params(SCENARIOS, [1, 2, 3, 4]))
def test_ring_moe_gloo(world, scenario, gloo_worlds):  # one spawned world per size for them all
    gloo_worlds.run(scenario, world, timeout=300)


def test_ring_moe_without_process_group_is_a_world_of_one():
    from relaymoe.ring import ring_moe

    assert not dist.is_initialized()
    pb = _problem(41, [6], 3, 2, 1)
    ref_out, ref_g = _oracle(pb)
    x = pb["x"].clone().requires_grad_()
    w13 = pb["w13"].clone().requires_grad_()
    w2 = pb["w2"].clone().requires_grad_()
    probs = pb["probs"].clone().requires_grad_()
    for mode in ("expert", "token"):
        out = ring_moe(x, w13, w2, pb["idx"], probs, config=RingConfig(mode=mode))
        assert _rel(out, ref_out) < 1e-12
        out.backward(pb["dy"])
        for got, key in ((x, "x"), (w13, "w13"), (w2, "w2"), (probs, "probs")):
            assert _rel(got.grad, ref_g[key]) < 1e-12, (mode, key)
            got.grad = None
    with pytest.raises(ValueError, match="outside"):
        ring_moe(x, w13, w2, pb["idx"] + 3, probs)


@pytest.mark.parametrize("form", ["separate", "reversed", "interleaved"])
def test_list_form_world_of_one_partial_grads(form):
    """List form without a process group: only the elements that require grad get one; the
    tensor form's gradients are reproduced per element."""
    from relaymoe.ring import ring_moe

    pb = _problem(42, [7], 3, 2, 1)
    ref_out, ref_g = _oracle(pb)
    fc1, fc2, _ = _weights(pb["w13"], pb["w2"], form)
    fc2[1].requires_grad_(False)
    for mode in ("expert", "token"):
        out = ring_moe(pb["x"], fc1, fc2, pb["idx"], pb["probs"], backend="torch",
                       config=RingConfig(mode=mode))  # fmt: skip
        assert _rel(out, ref_out) < 1e-12, mode
        out.backward(pb["dy"])
        for j in range(3):
            assert _rel(fc1[j].grad, ref_g["w13"][j]) < 1e-12, (mode, j)
            if j == 1:
                assert fc2[j].grad is None
            else:
                assert _rel(fc2[j].grad, ref_g["w2"][j]) < 1e-12, (mode, j)
            fc1[j].grad = fc2[j].grad = None
    with torch.no_grad():  # no backward needed: nothing is saved, nothing breaks
        out = ring_moe(pb["x"], fc1, fc2, pb["idx"], pb["probs"])
    assert not out.requires_grad and _rel(out, ref_out) < 1e-12
