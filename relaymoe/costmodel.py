"""The one cost model of an MoE layer step: link bytes, memory and time of every execution mode.

Pure Python (imports nothing from torch or ``relaymoe.ring``): the runtime's ``mode="auto"``
(``relaymoe.ring``), the planner (``relaymoe plan``) and the simulator all take their numbers
from here, so they cannot disagree.

Shape legend (one rank of the expert-parallel group): ``T`` tokens of the largest partition,
``H`` hidden, ``I`` expert FFN width, ``El`` experts per rank, ``E = El*R`` all experts, ``K``
top-k, ``R`` ranks, ``b`` bytes of an activation/weight element, ``pb`` bytes of a router
probability, ``gb`` bytes of a weight-gradient accumulator element (``b``, or 4 with fp32
accumulators: ``GRAD_ACCUMS``); expert ids travel as int32, so a token's routing metadata is
``m = K*(4 + pb)`` bytes; ``W = El*3*H*I`` elements of the local experts (SwiGLU: gate, up, down).

Modes (``MODES``):

* ``expert`` (ring): the weights travel. Per hop, forward ``W*b``; backward the weights and the
  trailing weight gradients ``W*(b + gb)``.
* ``token`` (ring): the tokens travel. Per hop, forward ``T*(H*b + m)`` lead plus the trailing
  output ``T*H*b``; backward ``T*(2*H*b + K*pb)`` lead (x, dy, probabilities: the forward kept
  every partition's routing index, so no ids travel) plus the trailing dx and dprobs
  ``T*(H*b + K*pb)``.
* ``alltoall`` (``relaymoe/ring/alltoall.py``): every rank sends each token once to every rank
  owning at least one of its K experts (x with its ids and probabilities); the owner computes
  all its pairs in one call and returns the partial outputs. The backward sends x and dy again
  (the forward's routing index and probabilities of the received rows are kept, no ids travel)
  and gets dx and dprobs back. Rows sent per rank ``S = T*R*q``, ``q`` the chance that a token
  has an expert on a given rank under uniform routing (``alltoall_rows``); ``1/R`` of them stay
  home, and a rank receives as many rows as it sends (in expectation).

The ring's schedule (``relaymoe/ring/schedule.py``): a pass has ``R`` hops; the lead is sent at
hops ``0..R-2``, the trail (when there is one) at hops ``1..R-1`` merged with the lead, and once
more after the last hop to return home.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "ALIGN",
    "DEFAULT_TIME_MODEL",
    "AUTO",
    "FP32_GRAD_ACCUM_MIN_EP",
    "GRAD_ACCUMS",
    "GRAD_ACCUM_CHOICES",
    "INDEX_BYTES",
    "INTER_NODE_BYTES_PER_S",
    "LINK_TRANSPORTS",
    "MODES",
    "MODE_CHOICES",
    "NIC_BYTES_PER_S",
    "NIC_EFFICIENCY",
    "NVLINK_BYTES_PER_S",
    "RING_MODES",
    "ROUTING_INDEX_BYTES_PER_PAIR",
    "NODE_BATCHED",
    "node_batched_hop_times",
    "node_batched_memory_bytes",
    "SCHEDULES",
    "SCHEDULE_CHOICES",
    "SYMM_GRANULE",
    "TRANSPORTS",
    "TRANSPORT_CHOICES",
    "CommVolume",
    "Dims",
    "HopBytes",
    "MemoryBytes",
    "RingHopTimes",
    "StepBytes",
    "TimeModel",
    "alltoall_rows",
    "choose_mode",
    "choose_schedule",
    "comm_volume",
    "dims",
    "grad_accum_bytes",
    "hop_bytes",
    "mcore_alltoall_memory_bytes",
    "mcore_alltoall_send_bytes",
    "memory_bytes",
    "order_partition",
    "order_rank",
    "ring_hop_times",
    "schedule_rank",
    "slot_capacity",
    "step_bytes",
    "step_seconds",
    "symmetric_workspace_bytes",
]

# The one place the mode and transport names are spelled; the runtime (``ring_moe``), the
# Megatron flags, the config, the planner and the simulator all import them from here.
AUTO = "auto"  # a request resolved by the runtime: choose_mode / the copy engine when it works
MODES = ("expert", "token", "alltoall")  # the order breaks ties in choose_mode
RING_MODES = ("expert", "token")
LINK_TRANSPORTS = ("nccl", "copy_engine")  # what a world of more than one rank may run over
TRANSPORTS = ("local", *LINK_TRANSPORTS)  # as resolved by the runtime (local: a world of 1)
MODE_CHOICES = (AUTO, *MODES)  # what a caller may ask for (ring_moe, flags, configs)
TRANSPORT_CHOICES = (AUTO, *LINK_TRANSPORTS)
# How the ring's ranks are ordered into hops (relaymoe/ring/schedule.py): one ring over the
# group ("flat"), or rings inside each node joined by one hop to the next node that every GPU
# of the node makes at once ("two_level"); "auto": two_level when the group spans nodes.
SCHEDULES = ("flat", "two_level")
# Expert mode only, asked for by name (not yet measured, so "auto" never picks it): rounds of a
# whole node's experts, all-gathered inside the node, the column of each local rank a ring
# across nodes (relaymoe/ring/nodebatch.py): one hop per node instead of per rank.
NODE_BATCHED = "node_batched"
SCHEDULE_CHOICES = (AUTO, *SCHEDULES, NODE_BATCHED)
# The dtype of the ring's weight-gradient accumulators (expert mode: the gradients that travel
# with their weights; token mode: the local ones every hop adds to): "param" (the weights' own,
# bf16), "fp32", or "auto": fp32 from FP32_GRAD_ACCUM_MIN_EP ranks. Each hop adds one rounding
# in a 16-bit accumulator, so the ring's weight-gradient error grows with EP while an all-to-all's
# single GEMM does not: measured over gloo (docs/lab-notes/numerics_2026-11-30.md) the ring's
# dw2 error was 1.55x the all-to-all's at EP 8 and 1.90x at EP 16, extrapolated 2.5x at EP 32.
GRAD_ACCUMS = ("param", "fp32")
GRAD_ACCUM_CHOICES = (AUTO, *GRAD_ACCUMS)
FP32_GRAD_ACCUM_MIN_EP = 16

# whether the host waits for a ring pass's transfers on CUDA (RELAYMOE_RING_HOST_WAIT): at the
# end of each pass for the one before it, and at a backward's end for its last (the default,
# first: a dead peer named a pass later, measured free), never, or at the end of each pass for
# the pass itself (a dead peer named at once, at a measured cost; ring/faults.py)
HOST_WAIT_CHOICES = ("lag", "off", "pass")

# The links a ring hop runs over (the planner's per-hop times; the simulator's Cluster defaults
# import them). NVLink: one way between the two GPUs of the lent 2x H200 machine, 1 GiB messages
# (measured: 394 GB/s one way, 741 both ways). Between nodes: one 400 Gb/s NIC
# per GPU (8 x 400 Gb/s per 8-GPU node, the H100 reference clusters: an assumption, no
# multi-node machine was measured) = 50 GB/s nominal, of which RDMA P2P of tens of MB reaches
# about 90% (assumption).
NVLINK_BYTES_PER_S = 394e9
NIC_BYTES_PER_S = 50e9
NIC_EFFICIENCY = 0.9
INTER_NODE_BYTES_PER_S = NIC_EFFICIENCY * NIC_BYTES_PER_S

INDEX_BYTES = 4  # expert ids travel as int32
ROUTING_INDEX_BYTES_PER_PAIR = 12  # expert_token_indices, token_expert_indices, token_index_map
ALIGN = 256  # every segment of a travelling buffer starts aligned (relaymoe/ring/layout.py)
SYMM_GRANULE = 2 * 1024 * 1024  # the copy-engine workspace grows in these (ring/transport.py)
# Megatron's alltoall dispatcher (the baseline): coexisting top-k-expanded (T*K, H) buffers and
# (T*K, I) expert intermediates, fit to megatron-core 0.19.2 (qwen3 T32k: 6464 MiB at EP=1,
# 7486 MiB at EP=2, the anchor measurement).
MCORE_A2A_BUFFERS_EP1 = 4.0
MCORE_A2A_BUFFERS_EP = 5.5
MCORE_A2A_INTERMEDIATES = 3


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dims:
    """One rank's view of an MoE layer (see the module docstring for the letters)."""

    T: int
    H: int
    I: int
    El: int
    K: int
    R: int
    b: int
    pb: int
    gb: int = 0  # bytes of a weight-gradient accumulator element; 0: b (the weights' dtype)

    def __post_init__(self):
        if self.gb == 0:
            object.__setattr__(self, "gb", self.b)
        for name in ("T", "H", "I", "El", "K", "R", "b", "pb", "gb"):
            v = getattr(self, name)
            lo = 0 if name == "T" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"cost model: {name}={v!r} must be an int >= {lo}")
        if self.K > self.E:
            raise ValueError(
                f"cost model: top-k K={self.K} exceeds E={self.E} experts (El={self.El} x "
                f"R={self.R}); use K <= E"
            )

    @property
    def E(self) -> int:
        return self.El * self.R

    @property
    def W(self) -> int:
        """Elements of the local experts (w13 (El, 2I, H) and w2 (El, H, I))."""
        return self.El * 3 * self.H * self.I

    @property
    def m(self) -> int:
        """Routing metadata bytes of one token: K int32 ids and K probabilities."""
        return self.K * (INDEX_BYTES + self.pb)

    @property
    def P(self) -> int:
        """Token-expert pairs of the partition."""
        return self.T * self.K


def _nbytes(dtype) -> int:
    """Bytes of an element: an int, or anything with ``itemsize`` (a torch.dtype)."""
    n = getattr(dtype, "itemsize", dtype)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"cost model: element size {dtype!r} is not a byte count nor a dtype")
    return n


def grad_accum_bytes(choice: str, world: int, act_bytes) -> int:
    """Bytes of a weight-gradient accumulator element for ``choice`` (GRAD_ACCUM_CHOICES) in a
    ring of ``world`` ranks whose weights have ``act_bytes`` (a byte count or a dtype)."""
    if choice not in GRAD_ACCUM_CHOICES:
        raise ValueError(
            f"grad_accum={choice!r} is not one of {GRAD_ACCUM_CHOICES} (fp32: weight-gradient "
            "accumulators in fp32; param: in the weights' dtype; auto: fp32 from "
            f"{FP32_GRAD_ACCUM_MIN_EP} ranks)"
        )
    b = _nbytes(act_bytes)
    fp32 = choice == "fp32" or (choice == AUTO and world >= FP32_GRAD_ACCUM_MIN_EP)
    return max(b, 4) if fp32 else b


def dims(
    *,
    tokens: int | Sequence[int],
    hidden: int,
    ffn: int,
    num_local_experts: int,
    topk: int,
    world: int,
    act_bytes=2,
    prob_bytes=4,
    grad_accum: str = AUTO,
) -> Dims:
    """``Dims`` from named sizes; ``tokens`` is one T or every rank's T (the largest counts:
    it bounds every hop). ``act_bytes``/``prob_bytes``: a byte count or a dtype;
    ``grad_accum``: the weight-gradient accumulators (GRAD_ACCUM_CHOICES)."""
    T = max(tokens) if isinstance(tokens, Sequence) else tokens
    b = _nbytes(act_bytes)
    return Dims(T, hidden, ffn, num_local_experts, topk, world, b, _nbytes(prob_bytes),
                grad_accum_bytes(grad_accum, world, b))  # fmt: skip


def _check_mode(mode: str, allowed: Sequence[str] = MODES) -> None:
    if mode not in allowed:
        raise ValueError(f"cost model: mode {mode!r} is not one of {tuple(allowed)}")


def _check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"cost model: transport {transport!r} is not one of {TRANSPORTS}")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _packed(*segments: int) -> int:
    """Bytes of segments packed as ``relaymoe.ring.layout.Layout`` does (each start aligned,
    the total ends at the last segment's end)."""
    offset = end = 0
    for s in segments:
        end = offset + s
        offset = _align(end)
    return end


# ---------------------------------------------------------------------------------------------
# bytes on the links
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HopBytes:
    """Bytes one rank sends at one hop of a ring mode, payload only (no alignment padding)."""

    fwd_lead: int
    fwd_trail: int
    bwd_lead: int
    bwd_trail: int

    @property
    def fwd(self) -> int:
        return self.fwd_lead + self.fwd_trail

    @property
    def bwd(self) -> int:
        return self.bwd_lead + self.bwd_trail

    @property
    def step(self) -> int:
        return self.fwd + self.bwd


def _ring_hop_bytes(
    mode: str, T: int, H: int, I: int, El: int, K: int, b: int, pb: int, gb: int | None = None
):
    """Sizes as plain ints, so that ``comm_volume`` may take sizes ``Dims`` refuses (0).
    ``gb``: bytes of a weight-gradient accumulator element (default ``b``)."""
    if mode == "expert":
        w = El * 3 * H * I
        return HopBytes(fwd_lead=w * b, fwd_trail=0, bwd_lead=w * b, bwd_trail=w * (gb or b))
    x, ids, probs = T * H * b, T * K * INDEX_BYTES, T * K * pb
    return HopBytes(
        fwd_lead=x + ids + probs, fwd_trail=x, bwd_lead=2 * x + probs, bwd_trail=x + probs
    )


def hop_bytes(mode: str, d: Dims) -> HopBytes:
    """Per-hop bytes of a ring mode (RelayMoE Table 2; expert mode's travelling weight
    gradients in ``d.gb`` bytes an element)."""
    _check_mode(mode, RING_MODES)
    return _ring_hop_bytes(mode, d.T, d.H, d.I, d.El, d.K, d.b, d.pb, d.gb)


def alltoall_rows(d: Dims) -> float:
    """Expected rows one rank sends in alltoall mode, its own included: ``S = T*R*q`` with
    ``q = 1 - C(E-El, K)/C(E, K)`` (a token's K distinct experts drawn uniformly; ``q`` is the
    chance that at least one lies on a given rank)."""
    q = 1.0 - math.comb(d.E - d.El, d.K) / math.comb(d.E, d.K)
    return d.T * d.R * q


@dataclass(frozen=True)
class StepBytes:
    """Bytes one rank sends over its links in one layer step (forward, backward)."""

    fwd: float
    bwd: float

    @property
    def step(self) -> float:
        return self.fwd + self.bwd


def step_bytes(mode: str, d: Dims, *, training: bool = True) -> StepBytes:
    """Link bytes of one layer step on one rank. Ring: the lead ``R-1`` times and the trail
    ``R`` times per pass (the schedule in the module docstring). Alltoall: the ``(R-1)/R`` of
    the ``S`` rows that leave the rank, out and back."""
    _check_mode(mode)
    R = d.R
    if R == 1:
        return StepBytes(0.0, 0.0)
    if mode == "alltoall":
        away = alltoall_rows(d) * (R - 1) / R
        Hb = d.H * d.b
        fwd = away * ((Hb + d.m) + Hb)  # x and metadata out, the output back
        bwd = away * (2 * Hb + (Hb + d.K * d.pb))  # x and dy out, dx and dprobs back
    else:
        h = hop_bytes(mode, d)
        fwd = (R - 1) * h.fwd_lead + R * h.fwd_trail
        bwd = (R - 1) * h.bwd_lead + R * h.bwd_trail
    return StepBytes(float(fwd), float(bwd) if training else 0.0)


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
def _slot(lead: int, trail: int) -> int:
    """Largest slot of a pass: ``[lead | trail]``, the trail at an aligned offset (a hop with
    both exists once R >= 2; ring/schedule.py ``SlotLayout``)."""
    return _align(lead) + trail if trail else lead


def _pass_slots(mode: str, d: Dims) -> tuple[int, int]:
    """(forward, backward) slot bytes with the engine's layouts (ring/engine.py)."""
    T, H, K, b, pb = d.T, d.H, d.K, d.b, d.pb
    if mode == "expert":
        w = _packed(d.El * 2 * d.I * H * b, d.El * H * d.I * b)  # w13 | w2
        dw = _packed(d.El * 2 * d.I * H * d.gb, d.El * H * d.I * d.gb)  # dw13 | dw2
        return _slot(w, 0), _slot(w, dw)
    fwd_lead = _packed(T * H * b, T * K * INDEX_BYTES, T * K * pb)  # x | idx | probs
    bwd_lead = _packed(T * H * b, T * K * pb, T * H * b)  # x | probs | dy
    fwd_trail = T * H * b  # out
    bwd_trail = _packed(T * H * b, T * K * pb)  # dx | dprobs
    return _slot(fwd_lead, fwd_trail), _slot(bwd_lead, bwd_trail)


def slot_capacity(mode: str, d: Dims, *, training: bool = True) -> int:
    """Bytes of one of the two ring slots (``RingPlan.capacity``): the larger of the passes
    that run, since a forward that a backward follows reserves the backward's size at once.
    0 for a world of one (nothing travels) and for alltoall mode (no slots)."""
    _check_mode(mode)
    if d.R == 1 or mode == "alltoall":
        return 0
    fwd, bwd = _pass_slots(mode, d)
    return max(fwd, bwd) if training else fwd


def symmetric_workspace_bytes(mode: str, d: Dims, *, training: bool = True) -> int:
    """The copy-engine transport's persistent symmetric-memory workspace: two slots of
    ``capacity`` bytes rounded up to ``SYMM_GRANULE``, per (group, device), shared by all
    layers (so counted once per GPU, not per layer); at least one granule each, even when the
    slots are empty. 0 for a world of one and for alltoall mode (no slots)."""
    _check_mode(mode)
    if d.R == 1 or mode not in RING_MODES:
        return 0
    cap = slot_capacity(mode, d, training=training)
    return 2 * max(SYMM_GRANULE, -(-cap // SYMM_GRANULE) * SYMM_GRANULE)


@dataclass(frozen=True)
class MemoryBytes:
    """What one layer's MoE experts allocate besides their inputs, outputs and gradients.

    ``fwd`` / ``bwd``: transient peak of each pass (freed when it ends); ``saved``: kept from
    the forward to the backward; ``workspace``: persistent symmetric memory of the copy-engine
    transport, per (group, device) and shared by all layers.
    """

    fwd: int
    bwd: int
    saved: int
    workspace: int

    @property
    def transient(self) -> int:
        return max(self.fwd, self.bwd)

    @property
    def peak(self) -> int:
        """Peak of one layer step over its inputs (the workspace excluded: it is per GPU)."""
        return self.saved + self.transient


def _intermediates(pairs: int, d: Dims, backward: bool) -> int:
    """One compute call's expert intermediates over ``pairs``: the (pairs, 2I) pre-activation,
    the (pairs, I) activation and the (pairs, H) down-projection rows; the backward also the
    (pairs, 2I) gradient of the pre-activation (recomputed, never saved)."""
    return pairs * ((4 if backward else 2) * d.I + d.I + d.H) * d.b


def memory_bytes(
    mode: str,
    d: Dims,
    *,
    training: bool = True,
    transport: str = "copy_engine",
    weights_copy: bool = False,
) -> MemoryBytes:
    """The engine's memory bound of ``mode`` (ring/engine.py docstring, "Memory bound").

    Ring modes (a hop computes ``T*K/R`` pairs under uniform routing):
      expert fwd: two slots + one hop's intermediates;
      expert bwd: two slots (weights + trailing gradient), a gradient scratch ``W*gb``, the
      returned gradient ``W*gb`` (and its ``W*b`` cast when ``gb != b``) + one hop's
      intermediates;
      token fwd: two slots, an output scratch ``T*H*b``, one hop's intermediates;
      token bwd: two slots, a dx/dprobs scratch ``T*(H*b + K*pb)``, the local weight-gradient
      accumulator ``W*gb`` (and its cast), one hop's intermediates.
      The two slots are ``2*slot_capacity``: transient with ``nccl``, the persistent
      ``workspace`` with ``copy_engine``. ``weights_copy``: list-form weights not back to back
      in one storage cost ``W*b`` per pass in token mode and in a world of one.
      Saved: expert mode the own tokens' routing index; token mode the routing index of every
      visiting partition (built when it visits, reused by the backward: ``R`` of them).
    Alltoall mode: see ``_alltoall_memory`` (plain allocations, no symmetric memory).
    A world of one: plain local compute whatever the mode.
    """
    _check_mode(mode)
    _check_transport(transport)
    Wb = d.W * d.b

    def out(fwd: int, bwd: int, saved: int, workspace: int = 0) -> MemoryBytes:
        # inference runs no backward and keeps nothing for one
        return MemoryBytes(fwd, bwd if training else 0, saved if training else 0, workspace)

    own_index = ROUTING_INDEX_BYTES_PER_PAIR * d.P
    if d.R == 1:
        copy = Wb if weights_copy else 0
        fwd = _intermediates(d.P, d, False) + copy
        return out(fwd, Wb + _intermediates(d.P, d, True) + copy, own_index)
    if mode == "alltoall":
        return out(*_alltoall_memory(d, weights_copy))
    cap = slot_capacity(mode, d, training=training)
    persistent = transport == "copy_engine"
    slots = 0 if persistent else 2 * cap
    workspace = symmetric_workspace_bytes(mode, d, training=training) if persistent else 0
    hop_pairs = -(-d.P // d.R)
    Wg = d.W * d.gb + (Wb if d.gb != d.b else 0)  # an accumulator (and its cast to b)
    if mode == "expert":
        fwd = slots + _intermediates(hop_pairs, d, False)
        bwd = slots + d.W * d.gb + Wg + _intermediates(hop_pairs, d, True)
    else:
        copy = Wb if weights_copy else 0
        fwd = slots + d.T * d.H * d.b + _intermediates(hop_pairs, d, False) + copy
        bwd = slots + d.T * (d.H * d.b + d.K * d.pb) + Wg + copy
        bwd += _intermediates(hop_pairs, d, True)
        return out(fwd, bwd, own_index * d.R, workspace)
    return out(fwd, bwd, own_index, workspace)


def node_batched_memory_bytes(d: Dims, *, gpus_per_node: int, training: bool = True) -> MemoryBytes:
    """``memory_bytes`` of the expert ring's node-batched rounds (``NODE_BATCHED``, NCCL), as
    ``relaymoe/ring/engine.py`` holds them at once (uniform routing).

    At ``G = 1`` the hop runs on the visiting partition in place: the flat expert ring's. At
    ``G > 1`` a round holds the all-gathered ``G*El`` experts (``G*W*b``) and, backward, their
    fresh gradients (``G*W*gb``): first with the hop's intermediates (``G/R`` of the rank's
    pairs), then, the hop returned, with the ``G - 1`` gradient shares received by the
    reduce-scatter. Besides: the column's accumulator (``W*gb``; at home in a column of one
    node), over several nodes the column ring's two transfer slots, and at the end the returned
    gradient's cast (``W*b`` when ``gb != b``). H200, qwen3 T4k at EP 2 and ``G = 2``: 3,488.6
    MiB measured over the inputs, 3,488.4 from this count (with the output and dx)."""
    R = d.R
    G = _check_nodes(R, gpus_per_node)
    if G == 1:
        return memory_bytes("expert", d, training=training, transport="nccl")
    Wb, Wg = d.W * d.b, d.W * d.gb
    pairs = G * -(-d.P // R)
    slots = 2 * slot_capacity("expert", d, training=training) if R > G else 0
    fwd = slots + G * Wb + _intermediates(pairs, d, False)
    if not training:
        return MemoryBytes(fwd, 0, 0, 0)
    hop = G * Wb + G * Wg + _intermediates(pairs, d, True)
    exchange = G * Wb + G * Wg + (G - 1) * Wg
    cast = Wb if d.gb != d.b else 0
    bwd = slots + Wg + max(hop, exchange, cast)
    return MemoryBytes(fwd, bwd, ROUTING_INDEX_BYTES_PER_PAIR * d.P, 0)


def _alltoall_memory(d: Dims, weights_copy: bool) -> tuple[int, int, int]:
    """(fwd, bwd, saved) of alltoall mode, phase by phase as ``relaymoe/ring/alltoall.py``
    allocates and frees; a rank receives as many rows as it sends (``S``, in expectation) and
    computes its ``T*K`` pairs in one call.

    Forward: dispatch (the sent rows of x and metadata, the received x; then the received
    metadata), compute (received x and metadata, a copy of the ids, the expert output, one
    call's intermediates), combine (the expert output and the returned rows).
    Backward: dispatch (received x, sent and received dy), compute (received x and dy, dx and
    dprobs rows, the weight gradient ``W*b``, intermediates), return (dx/dprobs rows sent and
    received, the weight gradient). Saved: the received rows' routing index (over all K ids of
    a row) and probabilities, the sent rows' token ids (int64), the (T, R) int32 row map.
    ``weights_copy``: the call stacks list-form weights, ``W*b`` per pass.
    """
    S = math.ceil(alltoall_rows(d))
    Hb, m, Wb = d.H * d.b, d.m, d.W * d.b
    ids = S * d.K * INDEX_BYTES
    copy = Wb if weights_copy else 0
    fwd = copy + max(
        S * (m + 2 * Hb),
        S * (2 * m + Hb),
        S * (Hb + m) + ids + S * Hb + _intermediates(d.P, d, False),
        2 * S * Hb,
    )
    bwd = copy + max(
        3 * S * Hb,
        3 * S * Hb + S * d.K * d.pb + Wb + _intermediates(d.P, d, True),
        2 * S * (Hb + d.K * d.pb) + Wb,
    )
    saved = S * d.K * (ROUTING_INDEX_BYTES_PER_PAIR + d.pb) + 8 * S + 4 * d.T * d.R
    return fwd, bwd, saved


def mcore_alltoall_memory_bytes(d: Dims) -> int:
    """Megatron's alltoall dispatcher (the baseline, not a relaymoe mode): peak of one layer
    step over its inputs, router excluded: the local weight gradient ``W*b``, ``a`` coexisting
    top-k-expanded (T*K, H) buffers and three (T*K, I) expert intermediates."""
    a = MCORE_A2A_BUFFERS_EP1 if d.R == 1 else MCORE_A2A_BUFFERS_EP
    return int(d.W * d.b + a * d.P * d.H * d.b + MCORE_A2A_INTERMEDIATES * d.P * d.I * d.b)


def mcore_alltoall_send_bytes(d: Dims) -> float:
    """Megatron's alltoall dispatcher: bytes one rank sends in one all-to-all of its
    top-k-expanded (T*K, H) rows (``(R-1)/R`` of them leave the rank)."""
    return d.P * (d.R - 1) / d.R * d.H * d.b


# ---------------------------------------------------------------------------------------------
# time
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimeModel:
    """Calibration constants of ``step_seconds``, fitted on 2x H200 (EP=2, qwen3-30b-a3b widths,
    T 4k-64k per GPU, every mode in one
    process). A step is host-bound at small T (the host needs longer to issue the hops' kernels
    than the GPU to run them) and device-bound at large T, and neither hides the other fully:
    ``step = sqrt(host**2 + device**2)`` fits those rows within 8%. The host constants vary by
    up to 1.5x between lent machines of one kind (megatron-core's Python-bound layer took 33 and
    62 ms at T4k on two of them); the ratio ring/all-to-all host time stayed about 1.4."""

    # FLOP/s of the experts' fwd+bwd (18*T*K*H*I FLOPs, the backward's recompute included):
    # the T64k ring rows, host time removed.
    expert_tflops: float = 335e12
    # Ring link bandwidth (copy-engine pulls over NVLink): the T32k token-mode hop transfers
    # (136 MB in 0.40 ms forward, 269 MB in 0.56 ms backward).
    link_bytes_per_s: float = 340e9
    # Host time of one ring hop of one pass (launches and their Python, ~35 ops): the small-T
    # floor of the ring rows (11.4 ms at R=2, fwd+bwd = 4 hops, with ``call_fixed_s``).
    hop_fixed_s: float = 2.75e-3
    # Host time per ring_moe call besides the hops (cached agreement, routing index, autograd).
    call_fixed_s: float = 0.4e-3
    # Host time of one alltoall-mode step (fwd+bwd; half for a forward alone): the small-T
    # floor of its rows (one compute call per pass, the dispatch and combine, one host sync).
    alltoall_fixed_s: float = 7.5e-3
    # Effective per-rank all-to-all bandwidth of the alltoall mode's link bytes (NCCL): the
    # T64k rows.
    alltoall_bytes_per_s: float = 216e9
    # Share of a ring transfer hidden under its hop's compute with the copy engine (an overlap
    # probe on 2x H200: 93%) and with NCCL, whose kernels take SMs (51%).
    hide: float = 0.9
    nccl_hide: float = 0.5

    def __post_init__(self):
        for name in ("expert_tflops", "link_bytes_per_s", "alltoall_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TimeModel.{name}={getattr(self, name)!r} must be > 0")
        for name in ("hop_fixed_s", "call_fixed_s", "alltoall_fixed_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"TimeModel.{name}={getattr(self, name)!r} must be >= 0")
        for name in ("hide", "nccl_hide"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"TimeModel.{name}={getattr(self, name)!r} must lie in [0, 1]")


DEFAULT_TIME_MODEL = TimeModel()


def _compute_seconds(d: Dims, model: TimeModel, backward: bool) -> float:
    """One pass over all of the rank's pairs: 6*T*K*H*I FLOPs forward, twice that backward."""
    return (12.0 if backward else 6.0) * d.P * d.H * d.I / model.expert_tflops


def _exposed(transfer_s: float, compute_s: float, hide: float) -> float:
    """What a hop's compute leaves of its transfer: the part beyond ``hide`` x the compute,
    and never less than ``1 - hide`` of the transfer (contention). Monotone in the transfer."""
    return max(transfer_s - hide * compute_s, (1.0 - hide) * transfer_s)


def _ring_pass_exposed(
    lead: int, trail: int, hop_compute_s: float, R: int, hide: float, bytes_per_s: float
) -> float:
    """Exposed transfer seconds of one ring pass: hop 0 sends the lead, hops 1..R-2 lead and
    trail, hop R-1 the trail, each under its hop's compute; the trail's return home after the
    last hop has no compute to hide under."""
    sent = [lead] + [lead + trail] * (R - 2) + [trail]
    exposed = sum(_exposed(n / bytes_per_s, hop_compute_s, hide) for n in sent)
    return exposed + trail / bytes_per_s


def step_seconds(
    mode: str,
    d: Dims,
    *,
    training: bool = True,
    transport: str = "copy_engine",
    model: TimeModel = DEFAULT_TIME_MODEL,
) -> float:
    """Seconds of one layer's experts (forward, and backward when ``training``) on one rank:
    ``sqrt(host**2 + device**2)`` (see :class:`TimeModel`).

    Ring: host ``call_fixed + R*hop_fixed`` per pass; device the compute plus the transfers'
    exposed parts. Alltoall: host ``alltoall_fixed`` (half without a backward); device the
    compute plus link bytes / ``alltoall_bytes_per_s`` (no overlap).
    """
    _check_mode(mode)
    _check_transport(transport)
    passes = (False, True) if training else (False,)
    compute = sum(_compute_seconds(d, model, bwd) for bwd in passes)
    if mode == "alltoall":
        host = model.alltoall_fixed_s * (1.0 if training else 0.5)
        device = compute + step_bytes(mode, d, training=training).step / model.alltoall_bytes_per_s
        return math.hypot(host, device)
    host = model.call_fixed_s + len(passes) * d.R * model.hop_fixed_s
    device = compute
    if d.R > 1:
        hide = model.nccl_hide if transport == "nccl" else model.hide
        h = hop_bytes(mode, d)
        for bwd in passes:
            lead, trail = (h.bwd_lead, h.bwd_trail) if bwd else (h.fwd_lead, h.fwd_trail)
            c_hop = _compute_seconds(d, model, bwd) / d.R
            device += _ring_pass_exposed(lead, trail, c_hop, d.R, hide, model.link_bytes_per_s)
    return math.hypot(host, device)


def choose_mode(
    *,
    tokens: int | Sequence[int],
    hidden: int,
    ffn: int,
    num_local_experts: int,
    topk: int,
    world: int,
    act_bytes=2,
    prob_bytes=4,
    training: bool = True,
    transport: str = "copy_engine",
    model: TimeModel = DEFAULT_TIME_MODEL,
    modes: Sequence[str] = MODES,
    grad_accum: str = AUTO,
) -> str:
    """The fastest of ``modes`` by ``step_seconds`` (the runtime's ``mode="auto"`` and the
    planner's choice). Deterministic: the same floats on every rank; ties go to the earlier of
    expert, token, alltoall. A world of one is local compute whatever the mode: ``"expert"``.
    ``grad_accum``: the weight-gradient accumulators (expert mode's backward trail bytes)."""
    d = dims(
        tokens=tokens,
        hidden=hidden,
        ffn=ffn,
        num_local_experts=num_local_experts,
        topk=topk,
        world=world,
        act_bytes=act_bytes,
        prob_bytes=prob_bytes,
        grad_accum=grad_accum,
    )
    _check_transport(transport)
    wanted = tuple(modes)
    if not wanted:
        raise ValueError(f"choose_mode: modes is empty; pass a subset of {MODES}")
    for m in wanted:
        _check_mode(m)
    if d.R == 1:
        return "expert"
    best, best_s = None, math.inf
    for m in MODES:
        if m in wanted:
            s = step_seconds(m, d, training=training, transport=transport, model=model)
            if s < best_s:
                best, best_s = m, s
    return best


# ---------------------------------------------------------------------------------------------
# schedules: flat ring or two-level (nodes)
# ---------------------------------------------------------------------------------------------
def _check_nodes(world: int, gpus_per_node: int | None) -> int:
    """Ranks of the group per node (``world`` when ``None``: one node)."""
    if gpus_per_node is None:
        return world
    G = gpus_per_node
    if isinstance(G, bool) or not isinstance(G, int) or G < 1:
        raise ValueError(f"cost model: gpus_per_node={G!r} must be an int >= 1 (or None: one node)")
    if world > G and world % G:
        raise ValueError(
            f"cost model: the group's {world} ranks span nodes of gpus_per_node={G} but are "
            f"not a whole number of nodes; use a group of a multiple of {G} ranks, or one node"
        )
    return min(G, world)


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"cost model: schedule {schedule!r} is not one of {SCHEDULES}")


def _order_width(schedule: str, world: int, G: int) -> int:
    """Ranks per level-one ring of the schedule's order: the whole group for flat."""
    return G if schedule == "two_level" else world


def order_partition(step: int, rank: int, world: int, width: int) -> int:
    """The partition ``rank`` computes at ``step`` in the ring order whose level-one rings have
    ``width`` ranks (``world``: flat; ``G``: two-level over ``world/G`` nodes): round
    ``j = step // width`` brings node ``n - j``'s partitions, step ``i = step % width`` of it the
    one of local rank ``g - i + j``. The one definition of the order (``relaymoe/ring/schedule.py``
    runs it; no checks here: it is on the ring's per-hop path)."""
    n, g = divmod(rank, width)
    j, i = divmod(step, width)
    return (n - j) % (world // width) * width + (g - i + j) % width


def order_rank(step: int, partition: int, world: int, width: int) -> int:
    """The rank that computes ``partition`` at ``step``: the inverse of ``order_partition``."""
    pn, pg = divmod(partition, width)
    j, i = divmod(step, width)
    return (pn + j) % (world // width) * width + (pg + i - j) % width


def schedule_rank(
    schedule: str, step: int, partition: int, world: int, gpus_per_node: int | None = None
) -> int:
    """The rank that computes ``partition`` at ``step`` (``0..world-1``); the order of
    ``relaymoe/ring/schedule.py`` (``RingPlan.who``). Flat: ``(partition + step) mod R``.
    Two-level, ``G`` ranks per node, ``N = R/G`` nodes: round ``j = step // G`` runs on node
    ``partition's node + j``, step ``i = step % G`` of it on local rank ``g + i - j`` (mod G), so
    a partition moves ``g -> g+1`` inside a round and to the same local rank of the next node
    between rounds."""
    _check_schedule(schedule)
    G = _order_width(schedule, world, _check_nodes(world, gpus_per_node))
    return order_rank(step, partition, world, G)


def choose_schedule(*, world: int, gpus_per_node: int | None = None, requested: str = AUTO) -> str:
    """The schedule a ring of ``world`` ranks runs: ``requested`` unless ``auto``, else
    ``two_level`` when the group spans nodes of more than one GPU, ``flat`` otherwise (one node,
    or one GPU per node, where both orders are the same). ``ring_hop_times`` never finds the
    two-level order slower: it runs the same hops with the same compute, and only the hops
    around a node crossing send over the slow links, each over its own GPU's NIC."""
    if requested not in SCHEDULE_CHOICES:
        raise ValueError(f"cost model: schedule {requested!r} is not one of {SCHEDULE_CHOICES}")
    G = _check_nodes(world, gpus_per_node)
    if requested != AUTO:
        return requested
    return "two_level" if 1 < G < world else "flat"


def _hop_sends(schedule: str, R: int, G: int, hop: int, r: int, trail: bool) -> dict:
    """``{peer: (lead?, trail?)}`` of rank ``r`` at ``hop`` in ``0..R`` (``R``: the trail home):
    the lead goes to whoever computes its partition at the next step, the trail one hop behind
    along the same path, then home to the partition's owner; a lead and a trail for the same
    peer travel as one message."""
    W = _order_width(schedule, R, G)

    def partition(step: int) -> int:  # what r computes at ``step``
        return order_partition(step, r, R, W)

    out: dict[int, tuple[bool, bool]] = {}
    if hop <= R - 2:
        out[schedule_rank(schedule, hop + 1, partition(hop), R, G)] = (True, False)
    if trail and hop >= 1:
        p = partition(hop - 1)
        peer = schedule_rank(schedule, hop, p, R, G) if hop < R else p
        out[peer] = (peer in out, True)
    return out


@dataclass(frozen=True)
class RingHopTimes:
    """Per-hop times of one schedule for one layer step (``ring_hop_times``), seconds.

    A hop is ``inter`` when some rank's send of it crosses nodes, ``intra`` otherwise; counts
    are over the passes that run, the trail's return home included. ``intra_hop_s`` /
    ``inter_hop_s``: the slowest hop of that kind (its compute plus the exposed part of its
    transfers; 0 when there is none); ``transfer_s``: the slowest transfer of a hop of that kind
    alone. ``step_s``: the layer step, ``sqrt(host**2 + device**2)`` as ``step_seconds``.
    """

    schedule: str
    world: int
    gpus_per_node: int
    intra_hops: int
    inter_hops: int
    hop_compute_s: float  # the slowest pass's per-hop compute (backward when training)
    intra_hop_s: float
    inter_hop_s: float
    intra_transfer_s: float
    inter_transfer_s: float
    host_s: float
    device_s: float

    @property
    def nodes(self) -> int:
        return self.world // self.gpus_per_node

    @property
    def step_s(self) -> float:
        return math.hypot(self.host_s, self.device_s)


def ring_hop_times(
    mode: str,
    d: Dims,
    *,
    schedule: str,
    gpus_per_node: int | None = None,
    training: bool = True,
    transport: str = "copy_engine",
    model: TimeModel = DEFAULT_TIME_MODEL,
    inter_bytes_per_s: float = INTER_NODE_BYTES_PER_S,
) -> RingHopTimes:
    """Hop by hop times of a ring mode under ``schedule`` with ``gpus_per_node`` ranks of the
    group per node (``None``: one node). Every hop computes ``1/R`` of the rank's pairs and
    hides its sends under that compute as ``step_seconds`` does; a hop is as slow as its slowest
    rank, and a rank's messages to different peers run at once on their own links. Inside a
    node the links run at ``model.link_bytes_per_s`` over ``transport``; a flat ring that spans
    nodes runs all of them over NCCL (the copy engine needs the whole group on one node), the
    two-level ring keeps ``transport`` inside its nodes. Between nodes, one NIC per GPU at
    ``inter_bytes_per_s`` over NCCL. In one node both schedules give ``step_seconds``."""
    _check_mode(mode, RING_MODES)
    _check_schedule(schedule)
    _check_transport(transport)
    R = d.R
    G = _check_nodes(R, gpus_per_node)
    if not inter_bytes_per_s > 0:
        raise ValueError(f"cost model: inter_bytes_per_s={inter_bytes_per_s!r} must be > 0")
    passes = (False, True) if training else (False,)
    host = model.call_fixed_s + len(passes) * R * model.hop_fixed_s
    device = sum(_compute_seconds(d, model, bwd) for bwd in passes)
    spans = G < R
    intra_transport = "nccl" if spans and schedule == "flat" else transport
    hide_intra = model.nccl_hide if intra_transport == "nccl" else model.hide
    counts = {"intra": 0, "inter": 0}
    hop_s = {"intra": 0.0, "inter": 0.0}
    x_s = {"intra": 0.0, "inter": 0.0}
    c_max = 0.0
    h = hop_bytes(mode, d)
    for bwd in passes:
        lead, trail = (h.bwd_lead, h.bwd_trail) if bwd else (h.fwd_lead, h.fwd_trail)
        c_hop = _compute_seconds(d, model, bwd) / R
        c_max = max(c_max, c_hop)
        if R == 1:
            continue  # nothing travels
        for hop in range(R + 1):
            home = hop == R
            c = 0.0 if home else c_hop
            worst_exposed, worst_x, inter = 0.0, 0.0, False
            for r in range(R):
                for peer, (has_lead, has_trail) in _hop_sends(
                    schedule, R, G, hop, r, trail > 0
                ).items():
                    nbytes = (lead if has_lead else 0) + (trail if has_trail else 0)
                    if nbytes <= 0:
                        continue
                    crosses = r // G != peer // G
                    inter |= crosses
                    x = nbytes / (inter_bytes_per_s if crosses else model.link_bytes_per_s)
                    hide = model.nccl_hide if crosses else hide_intra
                    e = x if home else _exposed(x, c, hide)
                    worst_exposed, worst_x = max(worst_exposed, e), max(worst_x, x)
            if home and worst_x == 0.0:
                continue  # nothing trails: no hop home
            kind = "inter" if inter else "intra"
            counts[kind] += 1
            hop_s[kind] = max(hop_s[kind], c + worst_exposed)
            x_s[kind] = max(x_s[kind], worst_x)
            device += worst_exposed
    return RingHopTimes(
        schedule=schedule, world=R, gpus_per_node=G, intra_hops=counts["intra"],
        inter_hops=counts["inter"], hop_compute_s=c_max, intra_hop_s=hop_s["intra"],
        inter_hop_s=hop_s["inter"], intra_transfer_s=x_s["intra"],
        inter_transfer_s=x_s["inter"], host_s=host, device_s=device,
    )  # fmt: skip


def node_batched_hop_times(
    d: Dims,
    *,
    gpus_per_node: int | None = None,
    training: bool = True,
    model: TimeModel = DEFAULT_TIME_MODEL,
    inter_bytes_per_s: float = INTER_NODE_BYTES_PER_S,
) -> RingHopTimes:
    """Hop times of the expert ring's node-batched rounds (``NODE_BATCHED``,
    ``relaymoe/ring/nodebatch.py``): ``N = R/G`` hops a pass, each over ``G/R`` of the rank's
    pairs, after an all-gather of the node's ``G-1`` other partitions over NVLink (not hidden);
    the next partition (backward with the travelling gradients) crosses to the next node on
    this GPU's NIC under the compute; backward, the round's gradients are reduce-scattered in
    the node after it (not hidden). Every hop is ``inter`` when there are several nodes."""
    R = d.R
    G = _check_nodes(R, gpus_per_node)
    N = R // G
    passes = (False, True) if training else (False,)
    host = model.call_fixed_s + len(passes) * N * model.hop_fixed_s
    h = hop_bytes("expert", d)
    device, c_max, hop_max, row_max, x_max = 0.0, 0.0, 0.0, 0.0, 0.0
    for bwd in passes:
        c = _compute_seconds(d, model, bwd) * G / R
        lead, trail = (h.bwd_lead, h.bwd_trail) if bwd else (h.fwd_lead, 0)
        row = (G - 1) * (lead + trail) / model.link_bytes_per_s  # gather (+ reduce-scatter)
        for j in range(N + (1 if bwd and N > 1 else 0)):  # backward: the gradients home
            nbytes = (lead if j < N - 1 else 0) + (trail if 0 < j else 0)
            x = nbytes / inter_bytes_per_s if N > 1 else 0.0
            comp = c if j < N else 0.0
            e = _exposed(x, comp, model.nccl_hide) if comp else x
            hop = (row if j < N else 0.0) + comp + e
            device += hop
            hop_max, x_max = max(hop_max, hop), max(x_max, x)
        c_max, row_max = max(c_max, c), max(row_max, row)
    inter = N > 1
    hops = len(passes) * N + (1 if training and inter else 0)
    return RingHopTimes(
        schedule=NODE_BATCHED, world=R, gpus_per_node=G, intra_hops=0 if inter else hops,
        inter_hops=hops if inter else 0, hop_compute_s=c_max,
        intra_hop_s=0.0 if inter else hop_max, inter_hop_s=hop_max if inter else 0.0,
        intra_transfer_s=row_max, inter_transfer_s=x_max, host_s=host, device_s=device,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the ring's per-hop volume (public as relaymoe.ring.comm_volume / CommVolume)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommVolume:
    """Bytes one rank sends per hop, per ring mode and pass (RelayMoE Table 2)."""

    expert_fwd: int
    expert_bwd: int
    token_fwd: int
    token_bwd: int
    dims: Dims | None = field(default=None, repr=False, compare=False)

    @property
    def expert_step(self) -> int:
        """Forward + backward bytes per hop in expert mode."""
        return self.expert_fwd + self.expert_bwd

    @property
    def token_step(self) -> int:
        """Forward + backward bytes per hop in token mode."""
        return self.token_fwd + self.token_bwd

    def preferred(
        self,
        training: bool = True,
        *,
        transport: str = "copy_engine",
        model: TimeModel = DEFAULT_TIME_MODEL,
    ) -> str:
        """``"expert"`` or ``"token"``. Built with ``world``: ``choose_mode`` over the ring
        modes. Without it (a caller that does not know R): the smaller per-hop volume
        (forward+backward when training), ties to expert mode."""
        d = self.dims
        if d is not None and d.R > 1:
            return choose_mode(
                tokens=d.T, hidden=d.H, ffn=d.I, num_local_experts=d.El, topk=d.K, world=d.R,
                act_bytes=d.b, prob_bytes=d.pb, training=training, transport=transport,
                model=model, modes=RING_MODES,
            )  # fmt: skip
        if d is not None:
            return "expert"
        if training:
            return "expert" if self.expert_step <= self.token_step else "token"
        return "expert" if self.expert_fwd <= self.token_fwd else "token"


def comm_volume(
    num_tokens: int,
    hidden: int,
    ffn: int,
    num_local_experts: int,
    topk: int,
    *,
    dtype=2,
    prob_dtype=4,
    world: int | None = None,
    grad_accum: str = AUTO,
) -> CommVolume:
    """Per-hop bytes of both ring modes for a partition of ``num_tokens`` tokens (the largest).

    ``dtype`` / ``prob_dtype``: the activations' and the probabilities' dtype or byte count
    (default bf16, fp32). ``world``: the ring length, which ``preferred`` needs to use the time
    model (otherwise it compares bytes) and ``grad_accum`` its accumulators (GRAD_ACCUM_CHOICES;
    without ``world`` ``auto`` counts them in the weights' dtype).
    """
    for name, v in (
        ("num_tokens", num_tokens),
        ("hidden", hidden),
        ("ffn", ffn),
        ("num_local_experts", num_local_experts),
        ("topk", topk),
    ):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    b, pb = _nbytes(dtype), _nbytes(prob_dtype)
    gb = grad_accum_bytes(grad_accum, world or 1, b)
    # bytes only need the per-rank sizes; Dims (the time model) needs every size >= 1
    d = None
    if world is not None and min(hidden, ffn, num_local_experts, topk) >= 1:
        d = Dims(num_tokens, hidden, ffn, num_local_experts, topk, world, b, pb, gb)
    sizes = (num_tokens, hidden, ffn, num_local_experts, topk, b, pb, gb)
    e, t = _ring_hop_bytes("expert", *sizes), _ring_hop_bytes("token", *sizes)
    return CommVolume(expert_fwd=e.fwd, expert_bwd=e.bwd, token_fwd=t.fwd, token_bwd=t.bwd, dims=d)
