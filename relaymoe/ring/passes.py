"""What every pass of a ring call shares: the layouts of what travels, the pass plans and their
slot capacity, the transport, and the call (``runtime.RingCall``: its group, runtime, how a hop's
compute runs and this rank's options).

Shape legend as in ``engine.py``.

The layouts and pass plans of a problem are memoised by the (frozen, hashable) problem
(``functools.lru_cache``: a pure function of the problem, no state any call could change):
every pass of every layer asks for them, and building them again (a layout per partition and
direction, a plan's tables) was a tenth of a recorded pass's host time.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from relaymoe.ring.executor import relay
from relaymoe.ring.hop_graphs import HopGraphs, graphs_for
from relaymoe.ring.layout import Layout
from relaymoe.ring.problem import RingProblem
from relaymoe.ring.runtime import RingCall
from relaymoe.ring.plan import RingPlan
from relaymoe.ring.transport import CopyEngineTransport, P2PTransport, Transport
from relaymoe.ring.weights import LocalExperts

IDX = torch.int32  # expert ids travel as int32


def hop_graphs_of(prob: RingProblem, call: RingCall, device) -> HopGraphs | None:
    """The cache of recorded hop bodies a pass runs its hops through (the call's runtime's),
    or None (eager)."""
    how = call.hop
    return graphs_for(prob, how.backend, device, call.runtime) if how.capture else None


def hop_head(prob: RingProblem, call: RingCall, phase: str) -> tuple[str, str, int]:
    """The first part of a pass's recorded hops' keys, made once a pass: ``(mode, phase, n)``,
    ``n`` a small int standing for the backend, kernel options and activation (equal ones, one
    int, numbered by the call's runtime), so that the cache's lookup at every hop hashes no
    options object."""
    ids = call.runtime.kernel_choice_ids
    n = ids.setdefault((call.hop.backend, call.hop.kernels, prob.activation), len(ids))
    return prob.mode, phase, n


def hop_key(head: tuple, expert_range: tuple[int, int], rows: dict) -> tuple:
    """The host values a recorded hop keeps (its tensors' shapes are added by the cache):
    :func:`hop_head`'s, the hop's expert range and its pair-count keyword."""
    return (*head, expert_range, *rows.items())


def present(parts: dict[str, Tensor | None]) -> dict[str, Tensor]:
    """``parts`` without the absent (None) ones."""
    return {k: v for k, v in parts.items() if v is not None}


def transport_of(prob: RingProblem, call: RingCall) -> Transport | None:
    """The transport of the call's agreed ``prob.transport`` (None in a world of one)."""
    if prob.transport == "copy_engine":
        return CopyEngineTransport(call.group, call.runtime, call.timeout_s)
    if prob.transport == "nccl":
        return P2PTransport(call.group)
    return None


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def weights_layout(prob: RingProblem, prefix: str = "") -> Layout:
    """The experts' weights and biases, or with ``prefix="d"`` their gradient accumulators (in
    ``prob.accum_dtype``: fp32 for a long ring of 16-bit weights, see options.GRAD_ACCUMS):
    ``w13 (El, J, H) | w2 (El, H, I) [| b13 (El, J)] [| b2 (El, H)]``. The biases sit in the
    weights' partition, so the one transfer of a hop carries them (and their gradients trail
    with the weights' gradients); absent biases have no segment."""
    El, H, I, J = prob.num_local_experts, prob.hidden, prob.ffn, prob.fc1_rows
    dt = prob.accum_dtype if prefix == "d" else prob.dtype
    shapes = {"w13": (El, J, H), "w2": (El, H, I), "b13": (El, J), "b2": (El, H)}
    present = ("w13", "w2") + ("b13",) * prob.has_b13 + ("b2",) * prob.has_b2
    return Layout.of(*((prefix + n, dt, shapes[n]) for n in present))


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def token_lead(prob: RingProblem, T: int, backward: bool) -> Layout:
    """A visiting token partition: x, ids and probabilities forward; x, probabilities and dy
    backward (the forward kept each partition's routing index, so no ids travel)."""
    H, K = prob.hidden, prob.topk
    if backward:
        return Layout.of(
            ("x", prob.dtype, (T, H)),
            ("probs", prob.prob_dtype, (T, K)),
            ("dy", prob.dtype, (T, H)),
        )
    return Layout.of(
        ("x", prob.dtype, (T, H)), ("idx", IDX, (T, K)), ("probs", prob.prob_dtype, (T, K))
    )


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def token_trail(prob: RingProblem, T: int, backward: bool) -> Layout:
    H, K = prob.hidden, prob.topk
    if backward:
        return Layout.of(("dx", prob.dtype, (T, H)), ("dprobs", prob.prob_dtype, (T, K)))
    return Layout.of(("out", prob.dtype, (T, H)))


def ring_plan(prob: RingProblem, lead: list[int], trail: list[int] | None) -> RingPlan:
    return RingPlan(prob.rank, prob.world_size, lead, trail, gpus_per_node=prob.gpus_per_node)


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def expert_plans(prob: RingProblem) -> tuple[RingPlan, RingPlan]:
    R = prob.world_size
    w, dw = weights_layout(prob).nbytes, weights_layout(prob, "d").nbytes
    return ring_plan(prob, [w] * R, None), ring_plan(prob, [w] * R, [dw] * R)


def token_layouts(prob: RingProblem, backward: bool) -> dict:
    """A token-mode pass's ``lead_layout``/``trail_layout`` roles (partition ``p`` holds
    ``prob.tokens[p]`` tokens). Each layout is built once per token count and returned again
    after: the pass asks for them every hop, and the executor keys its views by them."""
    Ts = prob.tokens
    lead = functools.cache(lambda T: token_lead(prob, T, backward))
    trail = functools.cache(lambda T: token_trail(prob, T, backward))
    return {"lead_layout": lambda p: lead(Ts[p]), "trail_layout": lambda p: trail(Ts[p])}


@functools.lru_cache(maxsize=256)  # per problem: every pass asks (module doc)
def token_plans(prob: RingProblem) -> tuple[RingPlan, RingPlan]:
    Ts = prob.tokens
    fwd = ring_plan(
        prob,
        [token_lead(prob, t, False).nbytes for t in Ts],
        [token_trail(prob, t, False).nbytes for t in Ts],
    )
    bwd = ring_plan(
        prob,
        [token_lead(prob, t, True).nbytes for t in Ts],
        [token_trail(prob, t, True).nbytes for t in Ts],
    )
    return fwd, bwd


def capacity(fwd: RingPlan, bwd: RingPlan, prob: RingProblem) -> int:
    """Reserve the backward's slot size at forward when a backward follows (one allocation
    of the persistent copy-engine workspace instead of two)."""
    return max(fwd.capacity(), bwd.capacity()) if prob.needs_grad else fwd.capacity()


def ring_pass(prob: RingProblem, call: RingCall, device, phase: str, plan: RingPlan, **roles):
    """One ``relay`` pass of this call: the transport, device, call and labels every pass
    shares; ``roles``: the pass's own ``lead_layout``/``own_lead``/``trail_layout``/``compute``
    (and ``capacity``)."""
    return relay(
        plan,
        transport=transport_of(prob, call),
        device=device,
        call=call,
        mode=prob.mode,
        phase=phase,
        **roles,
    )


def pair_rows(prob: RingProblem, tokens_rank: int, experts_rank: int) -> dict[str, int]:
    """The hop primitives' pair-count keyword for one hop: the agreed count, else its bound."""
    if prob.pairs is not None:
        return {"n_pairs": prob.pairs[tokens_rank][experts_rank]}
    return {"max_pairs": prob.hop_pairs(tokens_rank, experts_rank)}


def local_parts(experts: LocalExperts, order: str) -> dict[str, Tensor | None]:
    """The local experts' ``(El, ...)`` forms by part name (``w13``, ``w2``, ``b13``, ``b2``;
    None for an absent bias) in ``order``'s rows, for a pass that computes with them directly
    (token mode, all-to-all mode, a world of one): views, or stacks for this pass only."""
    w13, w2, _ = experts.stacked(order)
    b13, b2 = experts.biases(order)
    return {"w13": w13, "w2": w2, "b13": b13, "b2": b2}


def mlp(prob: RingProblem, parts: dict[str, Tensor | None]) -> dict:
    """The hop primitives' expert-MLP keywords: the agreed activation and the biases of
    ``parts`` (a partition's views by name, or :func:`local_parts`; None when absent)."""
    return {"activation": prob.activation, "b13": parts.get("b13"), "b2": parts.get("b2")}


def bias_grads(grads: dict[str, Tensor | None]) -> dict:
    """The hop backward's bias-gradient buffers among ``grads`` (a trail's views, or local
    accumulators keyed ``db13``/``db2``): the present biases' only."""
    return {"db13": grads.get("db13"), "db2": grads.get("db2")}


def home_grads(prob: RingProblem, grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """The weight and bias gradients of this rank's experts by part name (``w13``, ...), from
    accumulators keyed ``dw13``, ... (any dtype), in the weights' dtype."""
    return {name[1:]: g.to(prob.dtype) for name, g in grads.items()}


def pack_own(experts: LocalExperts, views: dict[str, Tensor]) -> None:
    """The rank's own experts (weights and biases) into slot 0, in expert order (per element
    in list form)."""
    for name, view in views.items():
        experts.pack(name, view)
