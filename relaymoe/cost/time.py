"""Time of a layer step per mode (``TimeModel``, ``step_seconds``) and the auto choice."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from relaymoe.cost.dims import Dims, check_mode, check_transport, dims
from relaymoe.cost.traffic import hop_bytes, step_bytes
from relaymoe.options import MODES


@dataclass(frozen=True)
class TimeModel:
    """Calibration constants of ``step_seconds``, fitted on measured layer rows (EP=2,
    qwen3-30b-a3b widths, T 4k-64k per GPU, every mode in one process). A step is host-bound at
    small T (the host needs longer to issue the hops' kernels than the GPU to run them) and
    device-bound at large T, and neither hides the other fully, so
    ``step = sqrt(host**2 + device**2)``. The host constants depend on the machine; the ratio of
    ring to all-to-all host time is what the auto choice relies on."""

    # FLOP/s of the experts' fwd+bwd (18*T*K*H*I FLOPs, the backward's recompute included):
    # the T64k ring rows, host time removed.
    expert_tflops: float = 335e12
    # Ring link bandwidth (copy-engine pulls over NVLink): the T32k token-mode hop transfers.
    link_bytes_per_s: float = 340e9
    # Host time of one ring hop of one pass (launches and their Python, ~35 ops): the small-T
    # floor of the ring rows (fwd+bwd at R=2 is 4 hops, with ``call_fixed_s``).
    hop_fixed_s: float = 2.75e-3
    # The same with the hop's compute replayed from a CUDA graph (RingConfig.capture_hops):
    # the library's captured pass measured on one GPU (transfers left out, T4k, EP 2/8/64) fits
    # 0.104 ms a hop, the pass's set-up and return included (EP 2 0.218, EP 8 0.096, EP 64
    # 0.054; the hop's own range 0.049), against 0.774 for the eager pass; rounded up for the
    # transfer's issue it leaves out. An estimate until the captured ring is measured on two
    # GPUs; ``captured_hops()`` applies it.
    captured_hop_fixed_s: float = 0.15e-3
    # Host time per ring_moe call besides the hops (cached agreement, routing index, autograd).
    call_fixed_s: float = 0.4e-3
    # Host time of one alltoall-mode step (fwd+bwd; half for a forward alone): the small-T
    # floor of its rows (one compute call per pass, the dispatch and combine, one host sync).
    alltoall_fixed_s: float = 7.5e-3
    # Effective per-rank all-to-all bandwidth of the alltoall mode's link bytes (NCCL): the
    # T64k rows.
    alltoall_bytes_per_s: float = 216e9
    # Share of a ring transfer hidden under its hop's compute with the copy engine and with
    # NCCL, whose kernels take SMs (both from an overlap probe).
    hide: float = 0.9
    nccl_hide: float = 0.5

    def __post_init__(self):
        for name in ("expert_tflops", "link_bytes_per_s", "alltoall_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TimeModel.{name}={getattr(self, name)!r} must be > 0")
        for name in ("hop_fixed_s", "captured_hop_fixed_s", "call_fixed_s", "alltoall_fixed_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"TimeModel.{name}={getattr(self, name)!r} must be >= 0")
        for name in ("hide", "nccl_hide"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"TimeModel.{name}={getattr(self, name)!r} must lie in [0, 1]")

    def captured_hops(self) -> TimeModel:
        """This model with each ring hop's host time that of a replayed hop
        (``captured_hop_fixed_s``): what every consumer of ``hop_fixed_s`` (``step_seconds``,
        the hop orders, the simulator) then predicts for ``capture_hops``. The runtime's
        ``auto`` does not use it: capture is each rank's own choice, not agreed."""
        return replace(self, hop_fixed_s=self.captured_hop_fixed_s)


DEFAULT_TIME_MODEL = TimeModel()


def compute_seconds(d: Dims, model: TimeModel, backward: bool) -> float:
    """One pass over all of the rank's pairs: ``2*T*K*H*(J + I)`` FLOPs forward (fc1 and fc2;
    6*T*K*H*I with SwiGLU), twice that backward."""
    return (4.0 if backward else 2.0) * d.P * d.H * (d.J + d.I) / model.expert_tflops


def exposed_seconds(transfer_s: float, compute_s: float, hide: float) -> float:
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
    exposed = sum(exposed_seconds(n / bytes_per_s, hop_compute_s, hide) for n in sent)
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
    check_mode(mode)
    check_transport(transport)
    passes = (False, True) if training else (False,)
    compute = sum(compute_seconds(d, model, bwd) for bwd in passes)
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
            c_hop = compute_seconds(d, model, bwd) / d.R
            device += _ring_pass_exposed(lead, trail, c_hop, d.R, hide, model.link_bytes_per_s)
    return math.hypot(host, device)


def choose_mode(
    *,
    training: bool = True,
    transport: str = "copy_engine",
    model: TimeModel = DEFAULT_TIME_MODEL,
    modes: Sequence[str] = MODES,
    **sizes,
) -> str:
    """The fastest of ``modes`` by ``step_seconds`` (the runtime's ``mode="auto"`` and the
    planner's choice). ``sizes``: the keywords of :func:`dims` (tokens, hidden, ffn,
    num_local_experts, topk, world, act_bytes, prob_bytes, grad_accum). Deterministic: the same
    floats on every rank; ties go to the earlier of expert, token, alltoall. A world of one is
    local compute whatever the mode: ``"expert"``."""
    d = dims(**sizes)
    return choose_mode_for(d, training=training, transport=transport, model=model, modes=modes)


def choose_mode_for(
    d: Dims,
    *,
    training: bool = True,
    transport: str = "copy_engine",
    model: TimeModel = DEFAULT_TIME_MODEL,
    modes: Sequence[str] = MODES,
) -> str:
    """:func:`choose_mode` for sizes already held as ``Dims`` (the planner's shapes)."""
    check_transport(transport)
    wanted = tuple(modes)
    if not wanted:
        raise ValueError(f"choose_mode: modes is empty; pass a subset of {MODES}")
    for m in wanted:
        check_mode(m)
    if d.R == 1:
        return "expert"
    best, best_s = None, math.inf
    for m in MODES:
        if m in wanted:
            s = step_seconds(m, d, training=training, transport=transport, model=model)
            if s < best_s:
                best, best_s = m, s
    return best
