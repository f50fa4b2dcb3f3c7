"""The frozen problem: what a ``ring_moe`` call asks for and what every rank agreed on.

Also the collective-deciding options of this process (``RingSettings``, ``ring_settings``),
written into every agreement's row (``agree.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relaymoe import options
from relaymoe.activation import SWIGLU, ExpertActivation, as_activation

__all__ = [
    "RingProblem",
    "RingRequest",
    "RingSettings",
    "request_activation",
    "request_kernels",
    "ring_request",
    "ring_settings",
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
    agreement checks it). ``needs_grad``: a backward follows."""

    mode: str = "auto"
    transport: str = "auto"
    schedule: str = "auto"
    gpus_per_node: int | None = None  # None: from the ranks' hosts
    needs_grad: bool = True
    grad_accum: str = "auto"  # the weight-gradient accumulators (options.GRAD_ACCUM_CHOICES)
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


def request_kernels(value, opts: options.RingOptions) -> options.KernelOptions | str:
    """``value`` (``ring_moe``'s ``kernels=``) as the request holds it: ``opts.kernels`` for
    None, the ``KernelOptions`` itself, or the message of a bad value. Not raised here: the
    agreement reports it (``checks.py``, code 10) on every rank at once."""
    if value is None:
        return opts.kernels
    if isinstance(value, options.KernelOptions):
        return value
    return (
        f"kernels={value!r} must be a relaymoe.options.KernelOptions or None (None: this "
        "process's, relaymoe.options.defaults().kernels); pass KernelOptions(...)"
    )


def ring_request(
    opts: options.RingOptions,
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
    ``gpus_per_node``, ``grad_accum`` and ``kernels`` given (not None) overrides ``opts`` (the
    installed options, ``relaymoe.options.defaults()``), None takes ``opts``' value; an
    installed ``gpus_per_node`` of None reads the nodes from the hosts. Values are checked by
    the agreement, on every rank at once."""

    def pick(value, installed):
        return installed if value is None else value

    return RingRequest(
        pick(mode, opts.mode), pick(transport, opts.transport), pick(schedule, opts.schedule),
        pick(gpus_per_node, opts.gpus_per_node), needs_grad, pick(grad_accum, opts.grad_accum),
        backend, request_activation(activation), bool(capturable),
        request_kernels(kernels, opts),
    )  # fmt: skip


@dataclass(frozen=True)
class RingSettings:
    """The options that decide which collectives a call issues (see ``agree.py``), taken from
    this process's installed options and agreed across ranks in the agreement's row."""

    agree: str = "cached"  # RingOptions.agree (relaymoe.options.AGREE_CHOICES)
    pair_buffer_mib: int = 512  # KernelOptions.pair_buffer_mib


def ring_settings() -> RingSettings:
    """This process's collective-deciding options (``relaymoe.options.defaults()``)."""
    opts = options.defaults()
    return RingSettings(opts.agree, opts.kernels.pair_buffer_mib)


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
