"""Memory of each mode beside its inputs, outputs and gradients, and the baseline's."""

from __future__ import annotations

import math
from dataclasses import dataclass

from relaymoe.cost.dims import Dims, check_mode, check_transport, hop_pair_bytes, packed_bytes
from relaymoe.cost.links import (
    INDEX_BYTES,
    ROUTING_INDEX_BYTES_PER_PAIR,
    SYMM_GRANULE,
    align_up,
)
from relaymoe.cost.order import check_nodes
from relaymoe.cost.traffic import alltoall_rows
from relaymoe.options import RING_MODES

# Megatron's alltoall dispatcher (the baseline): coexisting top-k-expanded (T*K, H) buffers and
# the expert intermediates (fc1's (T*K, J) output and the (T*K, I) activation: 3 (T*K, I) with
# SwiGLU), fit to megatron-core 0.19.2 (qwen3 T32k: 6464 MiB at EP=1, 7486 MiB at EP=2, the
# anchor measurement).
MCORE_A2A_BUFFERS_EP1 = 4.0
MCORE_A2A_BUFFERS_EP = 5.5


def _slot(lead: int, trail: int) -> int:
    """Largest slot of a pass: ``[lead | trail]``, the trail at an aligned offset (a hop with
    both exists once R >= 2; ring/plan.py ``SlotLayout``)."""
    return align_up(lead) + trail if trail else lead


def _pass_slots(mode: str, d: Dims) -> tuple[int, int]:
    """(forward, backward) slot bytes with the engine's layouts (ring/engine.py)."""
    T, H, K, b, pb = d.T, d.H, d.K, d.b, d.pb
    if mode == "expert":
        w = packed_bytes(*d.weight_segments(b))  # w13 | w2 [| b13] [| b2]
        dw = packed_bytes(*d.weight_segments(d.gb))  # their gradients, in the accumulators' dtype
        return _slot(w, 0), _slot(w, dw)
    fwd_lead = packed_bytes(T * H * b, T * K * INDEX_BYTES, T * K * pb)  # x | idx | probs
    bwd_lead = packed_bytes(T * H * b, T * K * pb, T * H * b)  # x | probs | dy
    fwd_trail = T * H * b  # out
    bwd_trail = packed_bytes(T * H * b, T * K * pb)  # dx | dprobs
    return _slot(fwd_lead, fwd_trail), _slot(bwd_lead, bwd_trail)


def slot_capacity(mode: str, d: Dims, *, training: bool = True) -> int:
    """Bytes of one of the two ring slots (``RingPlan.capacity``): the larger of the passes
    that run, since a forward that a backward follows reserves the backward's size at once.
    0 for a world of one (nothing travels) and for alltoall mode (no slots)."""
    check_mode(mode)
    if d.R == 1 or mode == "alltoall":
        return 0
    fwd, bwd = _pass_slots(mode, d)
    return max(fwd, bwd) if training else fwd


def symmetric_workspace_bytes(mode: str, d: Dims, *, training: bool = True) -> int:
    """The copy-engine transport's persistent symmetric-memory workspace: two slots of
    ``capacity`` bytes rounded up to ``SYMM_GRANULE``, per (group, device), shared by all
    layers (so counted once per GPU, not per layer); at least one granule each, even when the
    slots are empty. 0 for a world of one and for alltoall mode (no slots)."""
    check_mode(mode)
    if d.R == 1 or mode not in RING_MODES:
        return 0
    cap = slot_capacity(mode, d, training=training)
    return 2 * max(SYMM_GRANULE, -(-cap // SYMM_GRANULE) * SYMM_GRANULE)


def packed_index_bytes(P: int, E: int) -> int:
    """Bytes of a routing index of ``P`` pairs over ``E`` experts built into one buffer (a
    recorded token forward's, ``hop_graphs.index_layout``): its four arrays back to back, each
    starting ``ALIGN``-aligned, in field order (int32 ids, int64 offsets, int32 ids, the map)."""
    return packed_bytes(4 * P, 8 * (E + 1), 4 * P, (8 if P >= 2**31 else 4) * P)


def captured_hop_bytes(mode: str, d: Dims, *, training: bool = True) -> int:
    """The static buffers of ``RingConfig.capture_hops`` (``relaymoe/ring/hop_graphs.py``) on
    one GPU for hops of ``d``'s shape: persistent and shared by all layers of that shape (one
    buffer per name, shape and dtype, whatever the hop's expert range, forward and backward
    alike), so counted once per GPU, beside the layers' peaks. 0 for alltoall mode (no hops).

    Only the copied tensors have one: forward the tokens ``x`` and ``out`` (``T*H*b`` each) and
    the probabilities ``T*K*pb``; backward adds ``dy`` and ``dx`` and ``dprobs``. The routing
    index (``ROUTING_INDEX_BYTES_PER_PAIR`` a pair and the ``E+1`` int64 offsets) is an input of
    expert mode's forward and backward and of token mode's backward (its forward builds it in the
    hop); token mode's forward also copies the visiting ids ``T*K*INDEX_BYTES``, and expert
    mode in a ring of ``R > 1`` without fc2 bias its range's ``El+1`` int64 offsets (one
    recorded hop of each direction for every range, ``hop_graphs.range_window``; one buffer,
    forward and backward alike). In a ring of
    ``R > 1`` token mode binds its visiting partition and trail by address too (views of the
    ring's slots and trail scratch, which recur hop to hop): only the routing index is copied.
    Not counted: the experts' weights and biases and their gradient accumulators, which are
    bound by address (no buffer, unless a hop's addresses exceed the cache's variant cap and it
    falls back to copies); the graphs' shared memory pool (at least one hop's intermediates, its
    pair buffers sized from the bound ``T*min(K, El)``, held while the cache lives instead of
    freed after each hop) and what a body returns from it (token mode's routing index of a
    visiting partition, held once per entry: a model of L layers records about 2L of them), whose
    size the allocator decides."""
    check_mode(mode)
    if mode not in RING_MODES:
        return 0
    THb, TKp = d.T * d.H * d.b, d.T * d.K * d.pb
    index = ROUTING_INDEX_BYTES_PER_PAIR * d.P + 8 * (d.E + 1)
    if mode == "expert":
        window = 8 * (d.El + 1) if d.R > 1 and not d.b2 else 0
        fwd, bwd = 2 * THb + TKp + index + window, 2 * THb + TKp
    elif d.R > 1:  # the visiting partition and the trail are bound: slot and scratch views
        fwd, bwd = 0, packed_index_bytes(d.P, d.E)
    else:
        fwd = 2 * THb + TKp + d.T * d.K * INDEX_BYTES
        bwd = 2 * THb + TKp + packed_index_bytes(d.P, d.E)
    return fwd + (bwd if training else 0)


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
    """One compute call's expert intermediates over ``pairs`` (``hop_pair_bytes`` a pair): the
    (pairs, J) pre-activation, the (pairs, I) activation and the (pairs, H) down-projection
    rows; the backward also the (pairs, J) gradient of the pre-activation (recomputed, never
    saved). A call over more pairs than a slice (``Dims.slice_pairs``) holds one slice's."""
    rows = pairs if d.slice_pairs is None else min(pairs, d.slice_pairs)
    return rows * hop_pair_bytes(d.J, d.I, d.H, d.b, backward)


def memory_bytes(
    mode: str,
    d: Dims,
    *,
    training: bool = True,
    transport: str = "copy_engine",
    weights_copy: bool = False,
    main_grads: bool = False,
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
    A world of one: plain local compute whatever the mode; backward, the weight gradient
    ``W*gb`` (and its cast).
    ``main_grads``: the call adds this rank's weight gradients into the caller's accumulators
    (``ring_moe(main_grads=)``, Megatron's ``main_grad`` under gradient-accumulation fusion),
    laid out as one span each (``ring/main_grads.py``): inside the weight-gradient kernel in a
    world of one, token mode and alltoall mode, so no weight-gradient accumulator and no cast
    exist; expert mode over a ring still trails its gradients home (``W*gb``), then adds them
    without the cast.
    """
    check_mode(mode)
    check_transport(transport)
    Wb = d.W * d.b

    def out(fwd: int, bwd: int, saved: int, workspace: int = 0) -> MemoryBytes:
        # inference runs no backward and keeps nothing for one
        return MemoryBytes(fwd, bwd if training else 0, saved if training else 0, workspace)

    own_index = ROUTING_INDEX_BYTES_PER_PAIR * d.P
    cast = Wb if d.gb != d.b and not main_grads else 0  # the returned gradient's cast to b
    # the local weight-gradient accumulator and its cast; none where the kernel adds in place
    Wg = 0 if main_grads else d.W * d.gb + cast
    if d.R == 1:
        copy = Wb if weights_copy else 0
        fwd = _intermediates(d.P, d, False) + copy
        return out(fwd, Wg + _intermediates(d.P, d, True) + copy, own_index)
    if mode == "alltoall":
        return out(*_alltoall_memory(d, weights_copy, 0 if main_grads else Wb))
    cap = slot_capacity(mode, d, training=training)
    persistent = transport == "copy_engine"
    slots = 0 if persistent else 2 * cap
    workspace = symmetric_workspace_bytes(mode, d, training=training) if persistent else 0
    hop_pairs = -(-d.P // d.R)
    if mode == "expert":  # a scratch and the gradient arriving home, then (no targets) its cast
        fwd = slots + _intermediates(hop_pairs, d, False)
        bwd = slots + 2 * d.W * d.gb + cast + _intermediates(hop_pairs, d, True)
    else:
        copy = Wb if weights_copy else 0
        fwd = slots + d.T * d.H * d.b + _intermediates(hop_pairs, d, False) + copy
        bwd = slots + d.T * (d.H * d.b + d.K * d.pb) + Wg + copy
        bwd += _intermediates(hop_pairs, d, True)
        return out(fwd, bwd, own_index * d.R, workspace)
    return out(fwd, bwd, own_index, workspace)


def node_batched_memory_bytes(
    d: Dims, *, gpus_per_node: int, training: bool = True, main_grads: bool = False
) -> MemoryBytes:
    """``memory_bytes`` of the expert ring's node-batched rounds (``NODE_BATCHED``, NCCL), as
    ``relaymoe/ring/engine.py`` holds them at once (uniform routing).

    At ``G = 1`` the hop runs on the visiting partition in place: the flat expert ring's. At
    ``G > 1`` a round holds the all-gathered ``G*El`` experts (``G*W*b``) and, backward, their
    fresh gradients (``G*W*gb``): first with the hop's intermediates (``G/R`` of the rank's
    pairs), then, the hop returned, with the ``G - 1`` gradient shares received by the
    reduce-scatter. Besides: the column's accumulator (``W*gb``; at home in a column of one
    node), over several nodes the column ring's two transfer slots, and at the end the returned
    gradient's cast (``W*b`` when ``gb != b``; none with ``main_grads``: the gradient is added
    into the caller's accumulators as it arrives home). Checked against a measured peak at
    ``G = 2`` (history in the module docstring)."""
    R = d.R
    G = check_nodes(R, gpus_per_node)
    if G == 1:
        return memory_bytes("expert", d, training=training, transport="nccl",
                            main_grads=main_grads)  # fmt: skip
    Wb, Wg = d.W * d.b, d.W * d.gb
    pairs = G * -(-d.P // R)
    slots = 2 * slot_capacity("expert", d, training=training) if R > G else 0
    fwd = slots + G * Wb + _intermediates(pairs, d, False)
    if not training:
        return MemoryBytes(fwd, 0, 0, 0)
    hop = G * Wb + G * Wg + _intermediates(pairs, d, True)
    exchange = G * Wb + G * Wg + (G - 1) * Wg
    cast = Wb if d.gb != d.b and not main_grads else 0
    bwd = slots + Wg + max(hop, exchange, cast)
    return MemoryBytes(fwd, bwd, ROUTING_INDEX_BYTES_PER_PAIR * d.P, 0)


def _alltoall_memory(d: Dims, weights_copy: bool, wgrad: int) -> tuple[int, int, int]:
    """(fwd, bwd, saved) of alltoall mode, phase by phase as ``relaymoe/ring/token_mode.py``
    allocates and frees; a rank receives as many rows as it sends (``S``, in expectation) and
    computes its ``T*K`` pairs in one call.

    Forward: dispatch (the sent rows of x and metadata, the received x; then the received
    metadata), compute (received x and metadata, a copy of the ids, the expert output, one
    call's intermediates), combine (the expert output and the returned rows).
    Backward: dispatch (received x, sent and received dy), compute (received x and dy, dx and
    dprobs rows, the weight gradient ``wgrad`` bytes, intermediates), return (dx/dprobs rows
    sent and received, the weight gradient). Saved: the received rows' routing index (over all
    K ids of a row) and probabilities, the sent rows' token ids (int64), the (T, R) int32 row
    map. ``weights_copy``: the call stacks list-form weights, ``W*b`` per pass; ``wgrad``: the
    weight gradient's bytes (``W*b``, 0 where it is added into the caller's accumulators).
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
        3 * S * Hb + S * d.K * d.pb + wgrad + _intermediates(d.P, d, True),
        2 * S * (Hb + d.K * d.pb) + wgrad,
    )
    saved = S * d.K * (ROUTING_INDEX_BYTES_PER_PAIR + d.pb) + 8 * S + 4 * d.T * d.R
    return fwd, bwd, saved


def mcore_alltoall_memory_bytes(d: Dims) -> int:
    """Megatron's alltoall dispatcher (the baseline, not a relaymoe mode): peak of one layer
    step over its inputs, router excluded: the local weight gradient ``W*b``, ``a`` coexisting
    top-k-expanded (T*K, H) buffers and the expert intermediates (T*K, J + I) (three (T*K, I)
    with SwiGLU)."""
    a = MCORE_A2A_BUFFERS_EP1 if d.R == 1 else MCORE_A2A_BUFFERS_EP
    return int(d.W * d.b + a * d.P * d.H * d.b + d.P * (d.J + d.I) * d.b)


def mcore_alltoall_send_bytes(d: Dims) -> float:
    """Megatron's alltoall dispatcher: bytes one rank sends in one all-to-all of its
    top-k-expanded (T*K, H) rows (``(R-1)/R`` of them leave the rank)."""
    return d.P * (d.R - 1) / d.R * d.H * d.b
