"""The frozen problem: what a ``ring_moe`` call asks for and what every rank agreed on.

The request is the call's ``RingConfig`` with its per-call keywords applied, plus what only the
call knows (whether a backward follows, the backend, the activation); its collective-deciding
options (``agree``, ``pair_buffer_mib``) are written into every agreement's row (``agree.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relaymoe import options
from relaymoe.activation import SWIGLU, ExpertActivation, as_activation

__all__ = [
    "RingProblem",
    "RingRequest",
    "request_activation",
    "request_kernels",
    "ring_request",
]


def request_activation(value) -> ExpertActivation | str:
    """``value`` (``ring_moe``'s ``activation=``) as the request holds it: the
    ``ExpertActivation``, or the message of ``as_activation``'s ``ValueError`` when it is not
    one. Not raised here: the agreement reports it (``checks.py``, code 9) on every rank at
    once, so a rank with a bad activation fails its peers instead of leaving them waiting."""
    try:
        return as_activation(value)
    except ValueError as err:
        return str(err)


@dataclass(frozen=True)
class RingRequest:
    """What the caller of one ``ring_moe`` call asks for; every rank must ask the same (the
    agreement checks it). Made by :func:`ring_request` from the call's ``RingConfig`` (whose
    fields of the same names define each option, its choices and its default), each keyword
    given overriding its field; held unchecked, so that the agreement reports a bad value on
    every rank at once. ``needs_grad``: a backward follows."""

    mode: str
    transport: str
    schedule: str
    gpus_per_node: int | None  # None: from the ranks' hosts
    needs_grad: bool
    grad_accum: str  # the weight-gradient accumulators
    # the collective-deciding options (RingConfig.agree, KernelOptions.pair_buffer_mib): agreed
    # in the row, so ranks launched with different values all raise
    agree: str
    pair_buffer_mib: int
    backend: str = "auto"  # the hop primitives' backend on this rank (not compared across ranks)
    # the expert MLP (request_activation: an ExpertActivation, or the message of a bad one)
    activation: ExpertActivation | str = SWIGLU
    # the call is (also) captured in a CUDA graph: "auto" picks among the ring modes, and the
    # all-to-all (host-sized messages) is refused (``capture.py``)
    capturable: bool = False
    # the hop kernels' options (request_kernels: a KernelOptions, or the message of a bad value;
    # None: not given). This rank's choice: not compared across ranks, nor part of a trusted
    # call's cached signature (its validity is: agree.py)
    kernels: options.KernelOptions | str | None = field(default=None, compare=False)


def request_kernels(value, config: options.RingConfig) -> options.KernelOptions | str:
    """``value`` (``ring_moe``'s ``kernels=``) as the request holds it: ``config.kernels`` for
    None, the ``KernelOptions`` itself, or the message of a bad value. Not raised here: the
    agreement reports it (``checks.py``, code 10) on every rank at once."""
    if value is None:
        return config.kernels
    if isinstance(value, options.KernelOptions):
        return value
    return (
        f"kernels={value!r} must be a relaymoe.options.KernelOptions or None (None: the "
        "call's config's, RingConfig.kernels); pass KernelOptions(...)"
    )


def ring_request(
    config: options.RingConfig,
    *,
    mode: str | None = None,
    transport: str | None = None,
    schedule: str | None = None,
    gpus_per_node: int | None = None,
    needs_grad: bool = True,
    grad_accum: str | None = None,
    backend: str = "auto",
    activation=None,
    kernels=None,
    capturable: bool = False,
) -> RingRequest:
    """The request of one call: each of ``mode``, ``transport``, ``schedule``,
    ``gpus_per_node``, ``grad_accum`` and ``kernels`` given (not None) overrides ``config``
    (the call's ``RingConfig``), None takes ``config``'s value; a ``gpus_per_node`` of None in
    both reads the nodes from the hosts. Values are checked by the agreement, on every rank at
    once."""

    def pick(value, configured):
        return configured if value is None else value

    return RingRequest(
        pick(mode, config.mode), pick(transport, config.transport),
        pick(schedule, config.schedule), pick(gpus_per_node, config.gpus_per_node), needs_grad,
        pick(grad_accum, config.grad_accum), config.agree, config.kernels.pair_buffer_mib,
        backend, request_activation(activation), bool(capturable),
        request_kernels(kernels, config),
    )  # fmt: skip


@dataclass(frozen=True)
class RingProblem:
    """What every rank agreed on: sizes of every partition and the resolved execution."""

    rank: int
    world_size: int
    num_local_experts: int
    hidden: int
    ffn: int
    topk: int
    dtype: torch.dtype
    prob_dtype: torch.dtype
    tokens: tuple[int, ...]  # T of every rank's token partition
    mode: str  # "expert" | "token"
    transport: str  # "nccl" | "copy_engine" | "local"
    needs_grad: bool
    # pairs[r][q]: pairs of rank r's tokens whose expert rank q owns, read in the same all-reduce
    # as the sizes, so a hop knows its pair count without a host sync of its own. None: the hops
    # size their buffers from the bound ``pair_bound`` (trusted callers, small T).
    pairs: tuple[tuple[int, ...], ...] | None
    # the hop order (schedule.RingPlan): "flat", or "two_level" over nodes of gpus_per_node
    # consecutive ranks (None for flat); or "node_batched" (expert mode, nodebatch.py)
    schedule: str = "flat"
    gpus_per_node: int | None = None
    # dtype of the weight-gradient accumulators (expert mode's travelling trail, token mode's
    # local sums): ``dtype`` or fp32 (cost.grad_accum_bytes)
    grad_dtype: torch.dtype | None = None
    # KernelOptions.pair_buffer_mib as agreed by every rank (``_bounded`` decides from it)
    pair_buffer_mib: int = 512
    # the expert MLP every rank computes, and which biases every rank's experts carry (they
    # travel with their weights in expert mode: ``passes.weights_layout``)
    activation: ExpertActivation = SWIGLU
    has_b13: bool = False
    has_b2: bool = False

    @property
    def accum_dtype(self) -> torch.dtype:
        return self.grad_dtype or self.dtype

    @property
    def fc1_rows(self) -> int:
        """J: rows of one expert's fc1 weight (``w13[e]``), ``activation.fc1_rows(ffn)``."""
        return self.activation.fc1_rows(self.ffn)

    @property
    def num_experts(self) -> int:
        return self.num_local_experts * self.world_size

    def hop_pairs(self, tokens_rank: int, experts_rank: int) -> int:
        """Rows of the pair buffers of one hop: rank ``tokens_rank``'s tokens against rank
        ``experts_rank``'s experts; exact when the counts were agreed, else the upper bound."""
        if self.pairs is not None:
            return self.pairs[tokens_rank][experts_rank]
        return self.tokens[tokens_rank] * min(self.topk, self.num_local_experts)

    @property
    def expert_range(self) -> tuple[int, int]:
        """This rank's experts ``[rank*E_local, (rank+1)*E_local)``."""
        return self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts
