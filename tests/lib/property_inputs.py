"""Random inputs of every layout and dtype for the public API, and their one rule: each call
either matches the float64 oracle within its dtype's bound (gradients included) or raises a
``ValueError`` from relaymoe, and which of the two is decided up front from the case.

Shared by the CPU property tests (``tests/lib/test_property_inputs.py``) and their GPU twin
(``tests/gpu/test_property_gpu.py``, bf16 and the compiled kernels).

Layouts (``LAYOUTS``): ``contiguous``; ``transposed`` (the last two dims in reverse memory
order: a column-major matrix; a vector: a column of a wider matrix); ``sliced`` (every other
element of the last dim of a wider buffer, one element in); ``expanded`` (stride 0 along dim 0:
every row holds the first row's values, so the case's values are those of the expanded
tensor).
"""

from __future__ import annotations

import collections
import dataclasses
import random
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from relaymoe.reference import moe_experts_reference

LAYOUTS = ("contiguous", "transposed", "sliced", "expanded")
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int64, torch.int32, torch.int16, torch.uint8)
OTHERS = (torch.bool, torch.complex64)
# relative error bounds (CONTRIBUTING.md): a case is bound by its least precise float input
BOUND = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def bound(*dtypes: torch.dtype) -> float:
    return max(BOUND[d] for d in dtypes)


def subnormal_floor(tol: float, *dtypes: torch.dtype) -> float:
    """Per element, the size below which ``tol`` cannot be asked of these dtypes: a few units
    of the subnormal spacing (``tiny * eps``, 6e-8 in float16) over ``tol``."""
    return max(4 * torch.finfo(d).tiny * torch.finfo(d).eps for d in dtypes) / tol


# ---------------------------------------------------------------------------------------------
# tensors in a layout
# ---------------------------------------------------------------------------------------------
def values(shape, dtype: torch.dtype, gen: torch.Generator, *, scale: float = 1.0):
    """Random values of ``dtype``: normal floats (rounded to the dtype), small integers, bits."""
    if dtype in FLOATS:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(0, 3, shape, generator=gen).to(dtype)


def in_layout(t: torch.Tensor, kind: str, *, dim: int = 0) -> torch.Tensor:
    """``t``'s values in the memory layout ``kind`` (``expanded`` replaces them, see above;
    ``dim``: the expanded dim)."""
    if kind == "contiguous" or t.dim() == 0:
        return t.contiguous()
    if kind == "transposed":
        if t.dim() < 2:  # a vector: a column of a row-major (n, 3) matrix
            col = torch.zeros((t.shape[0], 3), dtype=t.dtype, device=t.device)[:, 1]
            col.copy_(t)
            return col
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "sliced":
        big = torch.zeros((*t.shape[:-1], 2 * t.shape[-1] + 1), dtype=t.dtype, device=t.device)
        view = big[..., 1::2]
        view.copy_(t)
        return view
    if kind == "expanded":
        if t.shape[dim] == 0:
            return t.contiguous()
        return t.narrow(dim, 0, 1).expand_as(t)
    raise ValueError(kind)


def leaf(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an autograd leaf with its own strides (float dtypes require grad)."""
    t = t.detach()
    return t.requires_grad_() if t.dtype in FLOATS else t


def aliased_rows(t: torch.Tensor) -> bool:
    """Whether several elements of ``t`` share one memory location (a stride-0 dim of size > 1)."""
    return any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride(), strict=True))


def from_relaymoe(err: BaseException) -> bool:
    """Whether ``err`` was raised by relaymoe's own code (its innermost frame in the package)."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and "/relaymoe/" in frames[-1].filename.replace("\\", "/")


def attempt(who: str, valid: bool, call):
    """``call()``'s result, or None when relaymoe refused the case with a ValueError; asserts
    that a refusal comes exactly for an invalid case, from inside relaymoe, and that nothing
    else escapes (``who`` names the case in the messages)."""
    try:
        result = call()
    except ValueError as err:
        assert not valid, f"{who}: a valid case raised {err!r}"
        assert from_relaymoe(err), f"{who}: a ValueError from outside relaymoe: {err!r}"
        return None
    except Exception as err:
        raise AssertionError(f"{who}: {type(err).__name__} from inside: {err!r}") from err
    assert valid, f"{who}: an invalid case returned a result"
    return result


def tally_cases(run, cases, *, shown: int = 8) -> collections.Counter:
    """``run(case)``'s results (``"valid"``/``"refused"``) counted over every case. A case that
    breaks the rule does not stop the others: after the last case one AssertionError names how
    many broke it and the first ``shown`` of them, so one run tells every failure apart (a GPU
    call that dies midway, or a first failure hiding a pattern, otherwise tells nothing)."""
    tally, failures = collections.Counter(), []
    for case in cases:
        try:
            tally[run(case)] += 1
        except AssertionError as err:
            failures.append(str(err))
    if failures:
        listed = "\n".join(f"- {f[:700]}" for f in failures[:shown])
        raise AssertionError(
            f"{len(failures)} of {len(failures) + sum(tally.values())} cases broke the rule "
            f"(tally of the rest: {dict(tally)}); the first {min(shown, len(failures))}:\n{listed}"
        )
    return tally


def routing(T: int, E: int, K: int, route: str, gen: torch.Generator) -> torch.Tensor:
    """(T, K) int64 distinct expert ids; ``empty``: the last expert never picked (K < E)."""
    scores = torch.rand(T, E, generator=gen)
    if route == "empty" and K < E:
        scores[:, -1] = -1.0
    return torch.topk(scores, K, dim=1).indices


# ---------------------------------------------------------------------------------------------
# moe_experts
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoECase:
    seed: int
    T: int
    H: int
    I: int  # noqa: E741 - the shape legend's name
    E: int
    K: int
    route: str
    dtype: torch.dtype  # x's (and the weights', unless w_dtype)
    w_dtype: torch.dtype
    probs_dtype: torch.dtype
    idx_dtype: torch.dtype
    layouts: tuple[tuple[str, str], ...]  # (tensor name, layout)
    with_out: bool
    listed: bool
    backend: str
    recompute: str
    index: str  # none | same | copy | other

    def layout(self, name: str) -> str:
        return dict(self.layouts)[name]


def _broken_float_dtypes(rng: random.Random, breaker: float, dtype: torch.dtype):
    """The two rules a moe or loss case breaks alike, for its draw ``breaker`` under 0.12: under
    0.08 the inputs and the weights of one dtype that is no float, else the weights alone of
    another float than the inputs. Returns ``(dtype, w_dtype)``."""
    if breaker < 0.08:
        bad = rng.choice(INTS + OTHERS)
        return bad, bad
    return dtype, rng.choice([d for d in FLOATS if d != dtype])


MOE_TENSORS = ("x", "w13", "w2", "idx", "probs", "dy", "out")


def moe_cases(n: int, seed: int, *, backends=("torch",), dtypes=FLOATS, device_kinds=()):
    """``n`` random cases; most are valid (floats of one dtype), about a quarter break one rule
    (an integer, bool or complex dtype, a weight of another dtype, an index of another
    routing, an expanded out)."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        E = rng.choice((1, 2, 3, 4, 5))
        K = rng.choice(sorted({1, E, rng.randint(1, E)}))
        dtype = rng.choice(dtypes)
        w_dtype, probs_dtype, idx_dtype = dtype, rng.choice(dtypes), rng.choice(INTS)
        index = rng.choice(("none", "none", "same", "copy"))
        breaker = rng.random()
        if breaker < 0.12:
            dtype, w_dtype = _broken_float_dtypes(rng, breaker, dtype)
        elif breaker < 0.16:
            probs_dtype = rng.choice(INTS + OTHERS)
        elif breaker < 0.20:
            idx_dtype = rng.choice((torch.float32, torch.bool))
        elif breaker < 0.24:
            index = "other"
        cases.append(MoECase(
            seed=seed * 1000 + i, T=rng.choice((0, 1, 3, 7, 13)), H=rng.choice((1, 3, 5, 9)),
            I=rng.choice((1, 3, 5)), E=E, K=K, route=rng.choice(("uniform", "empty")),
            dtype=dtype, w_dtype=w_dtype, probs_dtype=probs_dtype, idx_dtype=idx_dtype,
            layouts=tuple((t, rng.choice(LAYOUTS)) for t in MOE_TENSORS),
            with_out=rng.random() < 0.4, listed=rng.random() < 0.2,
            backend=rng.choice(backends), recompute=rng.choice(("act", "act_retain", "fc1")),
            index=index,
        ))  # fmt: skip
    return cases


def _moe_inputs(c: MoECase, device):
    g = torch.Generator().manual_seed(c.seed)
    x = values((c.T, c.H), c.dtype, g)
    w13 = values((c.E, 2 * c.I, c.H), c.w_dtype, g, scale=c.H**-0.5)
    w2 = values((c.E, c.H, c.I), c.w_dtype, g, scale=c.I**-0.5)
    idx = routing(c.T, c.E, c.K, c.route, g)
    other = routing(c.T, c.E, c.K, c.route, g)
    probs = (torch.rand(c.T, c.K, generator=g, dtype=torch.float64) + 0.1).to(
        c.probs_dtype if c.probs_dtype in FLOATS else torch.float64
    )
    if c.probs_dtype not in FLOATS:
        probs = values((c.T, c.K), c.probs_dtype, g)
    dy = values((c.T, c.H), torch.float64, g)
    out0 = values((c.T, c.H), c.dtype if c.dtype in FLOATS else torch.float64, g)
    t = dict(x=x, w13=w13, w2=w2, idx=idx.to(c.idx_dtype), probs=probs, dy=dy, out=out0)
    t = {k: in_layout(v.to(device), c.layout(k)) for k, v in t.items()}
    return t, other.to(device)


def moe_expect_valid(c: MoECase, t: dict, other: torch.Tensor) -> bool:
    if c.dtype not in FLOATS or c.w_dtype != c.dtype or c.probs_dtype not in FLOATS:
        return False
    if c.idx_dtype in FLOATS or c.idx_dtype == torch.bool:
        return False
    if c.backend == "triton" and c.dtype == torch.float64:
        return False
    if c.with_out and aliased_rows(t["out"]):
        return False
    return not (c.index == "other" and not torch.equal(other, t["idx"].long()))


def run_moe_case(c: MoECase, device="cpu", kernels=None) -> str:
    """Run one case; returns ``"valid"`` or ``"refused"``; raises AssertionError naming the case
    when the rule is broken. ``kernels``: ``moe_experts``' (a ``KernelOptions``; None: the
    defaults)."""
    from relaymoe.experts import moe_experts
    from relaymoe.routing import build_routing_index

    t, other = _moe_inputs(c, device)
    valid = moe_expect_valid(c, t, other)
    x, w13, w2, probs = (leaf(t[k]) for k in ("x", "w13", "w2", "probs"))
    idx = t["idx"]
    ws13 = [leaf(w) for w in w13.detach().unbind(0)] if c.listed else w13
    ws2 = [leaf(w) for w in w2.detach().unbind(0)] if c.listed else w2
    out = t["out"] if (c.with_out and c.dtype in FLOATS) else None
    out0 = out.detach().double().clone() if out is not None else None
    kw = dict(recompute=c.recompute, backend=c.backend, out=out, kernels=kernels)

    def call():
        if c.index == "same":
            kw["index"] = build_routing_index(idx, c.E)
        elif c.index == "copy":
            kw["index"] = build_routing_index(idx.clone(), c.E)
        elif c.index == "other":
            kw["index"] = build_routing_index(other, c.E)
        y = moe_experts(x, ws13, ws2, idx, probs, **kw)
        y.backward(t["dy"].to(y.dtype))
        return y

    y = attempt(f"{c}", valid, call)
    if y is None:
        return "refused"
    _check_moe(c, x, ws13, ws2, idx, probs, t["dy"], y, out, out0)
    return "valid"


def _grad(w):
    return torch.stack([e.grad for e in w]) if isinstance(w, list) else w.grad


def _check_moe(c, x, w13, w2, idx, probs, dy, y, out, out0):
    w13v = torch.stack([e.detach() for e in w13]) if isinstance(w13, list) else w13
    w2v = torch.stack([e.detach() for e in w2]) if isinstance(w2, list) else w2
    ref, grads = moe_oracle(x, w13v, w2v, idx, probs, dy)
    scale, scales = moe_oracle(x, w13v, w2v, idx, probs, dy, absolute=True)
    tol = bound(c.dtype, c.probs_dtype)
    assert y.dtype == c.dtype and y.shape == (c.T, c.H), f"{c}: output {y.dtype} {y.shape}"
    want = ref + (out0.cpu() if out0 is not None else 0)
    _close(c, "out", y.detach(), want, tol, scale)
    if out is not None:
        _close(c, "the out buffer", out.detach(), want, tol, scale)
    for name, got, r, sc in zip(("dx", "dw13", "dw2", "dprobs"),
                                (x.grad, _grad(w13), _grad(w2), probs.grad), grads, scales,
                                strict=True):  # fmt: skip
        assert got is not None and got.dtype == (probs.dtype if name == "dprobs" else c.dtype), (
            f"{c}: {name} is {None if got is None else got.dtype}"
        )
        _close(c, name, got, r, tol, sc)


def moe_oracle(x, w13, w2, idx, probs, dy, *, absolute: bool = False):
    """float64 ``(out, [dx, dw13, dw2, dprobs])`` of the values given; ``absolute``: of their
    absolute values (the magnitude of the terms each result sums)."""
    ins = [t.detach().double().cpu() for t in (x, w13, w2, probs)]
    dy = dy.double().cpu()
    if absolute:
        ins, dy = [t.abs() for t in ins], dy.abs()
    ins = [t.requires_grad_() for t in ins]
    ref = moe_experts_reference(ins[0], ins[1], ins[2], idx.long().cpu(), ins[3])
    _oracle_backward(ref, ins, dy)
    return ref.detach(), [t.grad for t in ins]


def _oracle_backward(ref: torch.Tensor, ins: list[torch.Tensor], dy: torch.Tensor) -> None:
    """Backward of the oracle; inputs no pair reached (no tokens) get exact zero gradients."""
    if ref.requires_grad:
        ref.backward(dy.double().cpu())
    for t in ins:
        if t.grad is None:
            t.grad = torch.zeros_like(t)


def _close(c, name: str, got, ref, tol: float, scale=None) -> None:
    """``got`` within ``tol`` of ``ref`` (exactly zero where ``ref`` is); ``scale``: the
    oracle on absolute values, a floor for the denominator (see the module doc), as is the
    subnormal range of the case's dtypes."""
    got = got.detach().double().cpu()
    assert got.shape == ref.shape, f"{c}: {name} shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{c}: {name} has non-finite values"
    if ref.norm() == 0 and (scale is None or scale.norm() == 0):
        assert got.norm() == 0, f"{c}: {name} should be exactly zero, norm {got.norm()}"
        return
    floats = [d for d in (getattr(c, "dtype", None), getattr(c, "probs_dtype", None))
              if d in FLOATS]  # fmt: skip
    floor = subnormal_floor(tol, *floats) * ref.numel() ** 0.5
    if scale is not None:
        floor = max(floor, 0.25 * scale.double().cpu().norm().item())
    err = ((got - ref).norm() / max(ref.norm(), floor)).item()
    assert err < tol, f"{c}: {name} relative error {err:.3g} > {tol}"


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossCase:
    seed: int
    T: int
    H: int
    V: int
    dtype: torch.dtype
    w_dtype: torch.dtype
    label_dtype: torch.dtype
    out_of_range: bool
    layouts: tuple[tuple[str, str], ...]  # hidden, weight, labels, dy
    chunk: int | None
    smoothing: float
    impl: str
    uniform_dy: bool

    def layout(self, name: str) -> str:
        return dict(self.layouts)[name]


IGNORE = -100


def loss_cases(n: int, seed: int, *, impls=("torch",), dtypes=FLOATS):
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        dtype = rng.choice(dtypes)
        w_dtype, label_dtype, bad = dtype, rng.choice((torch.int64, torch.int32)), False
        breaker = rng.random()
        if breaker < 0.12:
            dtype, w_dtype = _broken_float_dtypes(rng, breaker, dtype)
        elif breaker < 0.16:
            label_dtype = rng.choice((torch.float32, torch.bool))
        elif breaker < 0.22:
            bad = True
        cases.append(LossCase(
            seed=seed * 1000 + i, T=rng.choice((0, 1, 3, 7, 13)), H=rng.choice((1, 3, 5, 9)),
            V=rng.choice((2, 3, 5, 11)), dtype=dtype, w_dtype=w_dtype, label_dtype=label_dtype,
            out_of_range=bad, layouts=tuple((t, rng.choice(LAYOUTS))
                                            for t in ("hidden", "weight", "labels", "dy")),
            chunk=rng.choice((None, 1, 2, 5)), smoothing=rng.choice((0.0, 0.0, 0.1)),
            impl=rng.choice(impls), uniform_dy=rng.random() < 0.5,
        ))  # fmt: skip
    return cases


def _loss_inputs(c: LossCase, device):
    g = torch.Generator().manual_seed(c.seed)
    h = values((c.T, c.H), c.dtype, g)
    w = values((c.V, c.H), c.w_dtype, g, scale=2 * c.H**-0.5)
    y = torch.randint(0, c.V, (c.T,), generator=g)
    y[::3] = IGNORE
    if c.out_of_range and c.T:
        y[-1] = c.V + 2
    labels = y.to(c.label_dtype) if c.label_dtype != torch.bool else y > 0
    dy = torch.rand(c.T, generator=g, dtype=torch.float64) + 0.5
    if c.uniform_dy:
        dy = torch.full((c.T,), 0.37, dtype=torch.float64)
    t = dict(hidden=h, weight=w, labels=labels, dy=dy)
    return {k: in_layout(v.to(device), c.layout(k), dim=-1 if k == "weight" else 0)
            for k, v in t.items()}  # fmt: skip


def loss_expect_valid(c: LossCase, t: dict) -> bool:
    if c.dtype not in FLOATS or c.w_dtype != c.dtype:
        return False
    if c.label_dtype in FLOATS or c.label_dtype == torch.bool:
        return False
    if c.smoothing and c.V < 2:
        return False
    labels = t["labels"].long()
    return not ((labels != IGNORE) & ((labels < 0) | (labels >= c.V))).any()


def run_loss_case(c: LossCase, device="cpu") -> str:
    from relaymoe.loss import linear_cross_entropy

    t = _loss_inputs(c, device)
    valid = loss_expect_valid(c, t)
    h, w = leaf(t["hidden"]), leaf(t["weight"])

    def call():
        loss = linear_cross_entropy(h, w, t["labels"], chunk_tokens=c.chunk,
                                    label_smoothing=c.smoothing, impl=c.impl)  # fmt: skip
        loss.backward(t["dy"].to(loss.dtype))
        return loss

    loss = attempt(f"{c}", valid, call)
    if loss is None:
        return "refused"
    want = torch.float64 if c.dtype == torch.float64 else torch.float32
    assert loss.dtype == want and loss.shape == (c.T,), f"{c}: loss {loss.dtype} {loss.shape}"
    ref, scales = loss_oracle(h, w, t["labels"].long(), t["dy"], c.smoothing)
    tol = bound(c.dtype)
    for name, got, r, sc in zip(("loss", "dhidden", "dweight"), (loss, h.grad, w.grad), ref,
                                scales, strict=True):  # fmt: skip
        assert got is not None and (name == "loss" or got.dtype == c.dtype), f"{c}: {name}"
        _close(c, name, got, r, tol, sc)
    return "valid"


def loss_oracle(h, w, y, dy, smoothing):
    """float64 ``((loss, dh, dw), scales)`` on the whole logits (Megatron's smoothing ``a`` is
    PyTorch's ``a * V / (V - 1)``). ``scales``: the magnitudes the gradients sum, from the
    logits' gradient's absolute value ``p + onehot`` (see the module doc)."""
    h = h.detach().double().cpu().requires_grad_()
    w = w.detach().double().cpu().requires_grad_()
    y, dy = y.cpu(), dy.double().cpu()
    V = w.shape[0]
    ls = smoothing * V / (V - 1) if smoothing else 0.0
    z = h @ w.T
    loss = F.cross_entropy(z, y, reduction="none", ignore_index=IGNORE, label_smoothing=ls)
    g = torch.where(y != IGNORE, dy, 0.0)
    loss.backward(g)
    counted = (y != IGNORE).double()
    hit = F.one_hot(torch.where(y != IGNORE, y, 0), V).double() * counted[:, None]
    mag = (z.detach().softmax(1) + hit + ls / V) * (g.abs() * counted)[:, None]
    scales = (loss.detach().abs(), mag @ w.detach().abs(), mag.T @ h.detach().abs())
    return (loss.detach(), h.grad, w.grad), scales


# ---------------------------------------------------------------------------------------------
# ring_moe (every rank builds the same global problem; each takes its tokens and experts)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingCase:
    seed: int
    tokens: tuple[int, ...]
    El: int
    K: int
    H: int
    I: int  # noqa: E741
    dtype: torch.dtype
    probs_dtype: torch.dtype
    idx_dtype: torch.dtype
    layout_seed: int  # each rank draws its own layouts from (layout_seed, rank)
    listed: bool
    mode: str
    backend: str
    route: str


def ring_cases(n: int, seed: int, world: int, *, backends=("torch",), dtypes=FLOATS):
    rng = random.Random(seed * 7 + world)
    cases = []
    for i in range(n):
        El = rng.choice((1, 2))
        E = El * world
        dtype, probs_dtype, idx_dtype = rng.choice(dtypes), rng.choice(dtypes), rng.choice(INTS)
        breaker = rng.random()
        if breaker < 0.08:
            dtype = rng.choice(INTS + OTHERS)
        elif breaker < 0.12:
            probs_dtype = rng.choice(INTS + OTHERS)
        elif breaker < 0.16:
            idx_dtype = rng.choice((torch.float32, torch.bool))
        cases.append(RingCase(
            seed=seed * 1000 + i, tokens=tuple(rng.choice((0, 1, 3, 7)) for _ in range(world)),
            El=El, K=rng.choice(sorted({1, E})), H=rng.choice((1, 3, 5)), I=rng.choice((1, 3)),
            dtype=dtype, probs_dtype=probs_dtype, idx_dtype=idx_dtype,
            layout_seed=rng.randrange(1 << 30), listed=rng.random() < 0.25,
            mode=rng.choice(("auto", "expert", "token", "alltoall")),
            backend=rng.choice(backends), route=rng.choice(("uniform", "empty")),
        ))  # fmt: skip
    return cases


def ring_expect_valid(c: RingCase) -> bool:
    if c.dtype not in FLOATS or c.probs_dtype not in FLOATS:
        return False
    if c.idx_dtype in FLOATS or c.idx_dtype == torch.bool:
        return False
    return not (c.backend == "triton" and c.dtype == torch.float64)


def run_ring_case(c: RingCase, rank: int, world: int, group, device="cpu", kernels=None) -> str:
    """One rank's share of a ring case (every rank of ``group`` runs it). ``kernels``: the
    call's ``RingConfig.kernels`` (a ``KernelOptions``; None: the defaults)."""
    from relaymoe.options import RingConfig
    from relaymoe.ring import ring_moe

    E, total = c.El * world, sum(c.tokens)
    g = torch.Generator().manual_seed(c.seed)
    x = values((total, c.H), c.dtype, g)
    w13 = values((E, 2 * c.I, c.H), c.dtype, g, scale=c.H**-0.5)
    w2 = values((E, c.H, c.I), c.dtype, g, scale=c.I**-0.5)
    idx = routing(total, E, c.K, c.route, g)
    probs = torch.rand(total, c.K, generator=g, dtype=torch.float64) + 0.1
    probs = probs.to(c.probs_dtype) if c.probs_dtype in FLOATS else values(
        (total, c.K), c.probs_dtype, g)  # fmt: skip
    dy = values((total, c.H), torch.float64, g)
    # every rank draws every rank's layouts from the case, so each knows the values all passed
    # (an expanded slice repeats its first row) and the oracle runs on those
    parts = [_ring_part(c, q, world, dict(x=x, w13=w13, w2=w2, idx=idx, probs=probs, dy=dy),
                        device) for q in range(world)]  # fmt: skip
    mine = parts[rank]
    x, w13, w2, idx, probs, dy = (torch.cat([p[k].cpu() for p in parts])
                                  for k in ("x", "w13", "w2", "idx", "probs", "dy"))  # fmt: skip
    valid = ring_expect_valid(c)
    xl, w13l, w2l, pl = (leaf(mine[k]) for k in ("x", "w13", "w2", "probs"))
    ws13 = [leaf(w) for w in w13l.detach().unbind(0)] if c.listed else w13l
    ws2 = [leaf(w) for w in w2l.detach().unbind(0)] if c.listed else w2l

    config = RingConfig(mode=c.mode)
    config = config if kernels is None else config.replace(kernels=kernels)

    def call():
        y = ring_moe(xl, ws13, ws2, mine["idx"], pl, group=group, backend=c.backend,
                     config=config)  # fmt: skip
        y.backward(mine["dy"].to(y.dtype))
        return y

    y = attempt(f"{c} rank {rank}", valid, call)
    if y is None:
        return "refused"
    ref, grads = moe_oracle(x, w13, w2, idx, probs, dy)
    scale, scales = moe_oracle(x, w13, w2, idx, probs, dy, absolute=True)
    lo, hi = sum(c.tokens[:rank]), sum(c.tokens[: rank + 1])
    e0, e1 = rank * c.El, (rank + 1) * c.El
    rows = (slice(lo, hi), slice(e0, e1), slice(e0, e1), slice(lo, hi))
    tol = bound(c.dtype, c.probs_dtype)
    assert y.dtype == c.dtype, f"{c} rank {rank}: output dtype {y.dtype}"
    _close(c, f"rank {rank} out", y, ref[lo:hi], tol, scale[lo:hi])
    for name, got, r, sc, sl in zip(("dx", "dw13", "dw2", "dprobs"),
                                    (xl.grad, _grad(ws13), _grad(ws2), pl.grad), grads, scales,
                                    rows, strict=True):  # fmt: skip
        assert got is not None, f"{c} rank {rank}: no {name}"
        _close(c, f"rank {rank} {name}", got, r[sl], tol, sc[sl])
    return "valid"


def _ring_part(c: RingCase, q: int, world: int, full: dict, device) -> dict:
    """Rank ``q``'s inputs in rank ``q``'s layouts: its tokens' rows, its experts."""
    lo, hi = sum(c.tokens[:q]), sum(c.tokens[: q + 1])
    e0, e1 = q * c.El, (q + 1) * c.El
    lr = random.Random(c.layout_seed * 31 + q)
    part = dict(x=full["x"][lo:hi], w13=full["w13"][e0:e1], w2=full["w2"][e0:e1],
                idx=full["idx"][lo:hi].to(c.idx_dtype), probs=full["probs"][lo:hi],
                dy=full["dy"][lo:hi])  # fmt: skip
    return {k: in_layout(v.to(device), lr.choice(LAYOUTS)) for k, v in part.items()}


def replace(case, **kw):
    return dataclasses.replace(case, **kw)


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy over a tensor-parallel group (every rank builds the same problem)
# ---------------------------------------------------------------------------------------------
TP_BREAKS = ("none", "none", "none", "T", "Vl", "labels")


def tp_loss_cases(n: int, seed: int, world: int, *, impls=("torch",), dtypes=FLOATS):
    """Cases of :func:`loss_cases` without label smoothing (then every rank's loss is the
    unsharded one), each with ``break``: ``none``, or the contract the last rank breaks (one
    token more, one vocabulary row more, other labels)."""
    rng = random.Random(seed * 13 + world)
    base = loss_cases(n, seed, impls=impls, dtypes=dtypes)
    return [(replace(c, smoothing=0.0), rng.choice(TP_BREAKS)) for c in base]


def run_tp_loss_case(c: LossCase, broken: str, rank: int, world: int, group) -> str:
    """One rank's share of a tensor-parallel case (``world >= 2``): every rank raises the same
    ``ValueError`` when the case breaks a rule, else each rank's loss is the unsharded
    oracle's, the hidden-gradient parts add up to its gradient and the weight gradient is its
    shard's."""
    import torch.distributed as dist

    from relaymoe.loss import linear_cross_entropy

    V = c.V * world
    full = _loss_inputs(replace(c, V=V), "cpu")
    last = rank == world - 1 and broken != "none"
    lr = random.Random(c.seed * 31 + rank)
    h, labels, dy = full["hidden"], full["labels"], full["dy"]
    w = full["weight"][rank * c.V : (rank + 1) * c.V]
    if last and broken == "T":  # one token more (a zero one: T may be 0)
        h, labels, dy = (torch.cat([t, t.new_zeros((1, *t.shape[1:]))]) for t in (h, labels, dy))
    if last and broken == "Vl":
        w = torch.cat([w, w[:1]])
    if last and broken == "labels" and labels.numel():
        labels = labels.clone()
        labels[0] = (labels[0].long() + 1).to(labels.dtype) if labels.dtype != torch.bool else 0
    # each rank's own layout on top of the case's (none that changes values: the oracle is
    # the case's problem)
    h, w = (in_layout(t, lr.choice(LAYOUTS[:3])) for t in (h, w))
    hl, wl = leaf(h), leaf(w)
    kept = broken == "none" or (broken == "labels" and c.T == 0)  # the contract
    valid = kept and loss_expect_valid(replace(c, V=V), full)

    def call():
        loss = linear_cross_entropy(hl, wl, labels, tp_group=group, chunk_tokens=c.chunk,
                                    impl=c.impl)  # fmt: skip
        loss.backward(dy.to(loss.dtype))
        return loss

    loss = attempt(f"{c} {broken} rank {rank}", valid, call)
    if loss is None:
        return "refused"
    (ref, ref_dh, ref_dw), (s_loss, s_dh, s_dw) = loss_oracle(
        full["hidden"], full["weight"], full["labels"].long(), full["dy"], 0.0
    )
    dh = hl.grad.detach().double().clone()
    if world > 1:
        dist.all_reduce(dh, group=group)  # the hidden gradient's parts add up over the ranks
    shard = slice(rank * c.V, (rank + 1) * c.V)
    tol = bound(c.dtype)
    _close(c, f"rank {rank} loss", loss, ref, tol, s_loss)
    _close(c, f"rank {rank} summed dhidden", dh, ref_dh, tol * world, s_dh)
    _close(c, f"rank {rank} dweight", wl.grad, ref_dw[shard], tol, s_dw[shard])
    return "valid"
