"""``Dims``: one rank's view of an MoE layer, the sizes every cost is a function of."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from relaymoe.cost.links import INDEX_BYTES, align_up
from relaymoe.options import (
    AUTO,
    FP32_GRAD_ACCUM_MIN_EP,
    GRAD_ACCUM_CHOICES,
    HOP_SLICE_MIB,
    MODES,
    TRANSPORTS,
)


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
    # the expert MLP: a gated activation (fc1 of 2I rows, SwiGLU's) or not (I rows), and which
    # biases the experts carry (fc1's (J,), fc2's (H,) per expert: they travel with the weights)
    gated: bool = True
    b13: bool = False
    b2: bool = False
    # the budget of one hop's pair intermediates, MiB (KernelOptions.hop_slice_mib; 0: unsliced)
    slice_mib: int = HOP_SLICE_MIB

    def __post_init__(self):
        if self.gb == 0:
            object.__setattr__(self, "gb", self.b)
        for name in ("T", "H", "I", "El", "K", "R", "b", "pb", "gb", "slice_mib"):
            v = getattr(self, name)
            lo = 0 if name in ("T", "slice_mib") else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"cost model: {name}={v!r} must be an int >= {lo}")
        for name in ("gated", "b13", "b2"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"cost model: {name}={getattr(self, name)!r} must be a bool")
        if self.K > self.E:
            raise ValueError(
                f"cost model: top-k K={self.K} exceeds E={self.E} experts (El={self.El} x "
                f"R={self.R}); use K <= E"
            )

    @property
    def E(self) -> int:
        return self.El * self.R

    @property
    def J(self) -> int:
        """Rows of one expert's fc1 weight: 2I gated, I not (``ExpertActivation.fc1_rows``)."""
        return 2 * self.I if self.gated else self.I

    @property
    def W(self) -> int:
        """Elements of the local experts: w13 (El, J, H), w2 (El, H, I) and the biases they
        carry, b13 (El, J) and b2 (El, H) (what travels in expert mode, and what a gradient
        accumulator holds)."""
        per_expert = self.J * self.H + self.H * self.I
        per_expert += (self.J if self.b13 else 0) + (self.H if self.b2 else 0)
        return self.El * per_expert

    def weight_segments(self, elt: int) -> tuple[int, ...]:
        """Bytes of the local experts' segments at ``elt`` bytes an element, in the ring's
        layout order (``relaymoe.ring.plan.weights_layout``): w13, w2, then b13, b2 as
        carried."""
        El, H, I, J = self.El, self.H, self.I, self.J
        segs = [El * J * H * elt, El * H * I * elt]
        segs += [El * J * elt] if self.b13 else []
        segs += [El * H * elt] if self.b2 else []
        return tuple(segs)

    @property
    def m(self) -> int:
        """Routing metadata bytes of one token: K int32 ids and K probabilities."""
        return self.K * (INDEX_BYTES + self.pb)

    @property
    def P(self) -> int:
        """Token-expert pairs of the partition."""
        return self.T * self.K

    @property
    def slice_pairs(self) -> int | None:
        """Pairs of one slice of a hop's compute (``hop_slice_pairs``; None: unsliced)."""
        return hop_slice_pairs(self.slice_mib * 2**20, self.J, self.I, self.H, self.b)


# Slices of a hop hold a multiple of this many pairs (the kernels' row tiles divide it).
SLICE_QUANTUM = 256


def hop_pair_bytes(J: int, I: int, H: int, b: int, backward: bool = True) -> int:
    """Bytes of one pair's intermediates in a hop's compute, at ``b`` bytes an element: the
    (J) pre-activation, the (I) activation and the (H) down-projection row; the backward also
    the (J) pre-activation gradient (the activation is recomputed, never saved)."""
    return ((2 if backward else 1) * J + I + H) * b


def hop_slice_pairs(budget_bytes: int, J: int, I: int, H: int, b: int) -> int | None:
    """Pairs of one slice of a hop whose backward intermediates (``hop_pair_bytes``) fit
    ``budget_bytes``: a multiple of ``SLICE_QUANTUM``, at least one quantum; None for a budget
    of 0 (never sliced). The kernels (``relaymoe.kernels.select.hop_slice_rows``) and the memory
    model both take it from here."""
    if budget_bytes <= 0:
        return None
    rows = budget_bytes // hop_pair_bytes(J, I, H, b) // SLICE_QUANTUM * SLICE_QUANTUM
    return max(SLICE_QUANTUM, rows)


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
    gated: bool = True,
    b13: bool = False,
    b2: bool = False,
    slice_mib: int = HOP_SLICE_MIB,
) -> Dims:
    """``Dims`` from named sizes; ``tokens`` is one T or every rank's T (the largest counts:
    it bounds every hop). ``act_bytes``/``prob_bytes``: a byte count or a dtype;
    ``grad_accum``: the weight-gradient accumulators (GRAD_ACCUM_CHOICES); ``gated``: the
    activation is gated (``ExpertActivation.gated``); ``b13``/``b2``: the experts carry those
    biases; ``slice_mib``: the hop's slice budget (``KernelOptions.hop_slice_mib``)."""
    T = max(tokens) if isinstance(tokens, Sequence) else tokens
    b = _nbytes(act_bytes)
    return Dims(T, hidden, ffn, num_local_experts, topk, world, b, _nbytes(prob_bytes),
                grad_accum_bytes(grad_accum, world, b), gated, b13, b2, slice_mib)  # fmt: skip


def check_mode(mode: str, allowed: Sequence[str] = MODES) -> None:
    if mode not in allowed:
        raise ValueError(f"cost model: mode {mode!r} is not one of {tuple(allowed)}")


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"cost model: transport {transport!r} is not one of {TRANSPORTS}")


def packed_bytes(*segments: int) -> int:
    """Bytes of segments packed as ``relaymoe.ring.plan.Layout`` does (each start aligned,
    the total ends at the last segment's end)."""
    offset = end = 0
    for s in segments:
        end = offset + s
        offset = align_up(end)
    return end
