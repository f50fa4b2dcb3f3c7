"""relaymoe's settings in Megatron: ring mode/transport/overlap/schedule, fused loss (no Megatron
import).

Precedence, field by field: ``relaymoe.megatron.configure(...)`` > Megatron's parsed arguments
(``--relaymoe-ring-mode``, ``--relaymoe-transport``, ``--relaymoe-no-overlap``,
``--relaymoe-ring-schedule``, ``--relaymoe-gpus-per-node``, ``--relaymoe-grad-accum``,
``--relaymoe-ring-host-wait``, ``--relaymoe-fused-loss``,
``--relaymoe-loss-chunk-tokens``, read from ``megatron.training.get_args()`` when a training
script parsed them) > defaults (``auto``/``auto``/overlap on/``auto`` schedule with the nodes read
from the ranks' hosts/fused loss off/chunk chosen by ``relaymoe.linear_cross_entropy``).
Read once per model part at build time: the ring settings by each ``RingDispatcher``, the loss
settings by each ``GPTModel``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from relaymoe.options import (
    GRAD_ACCUM_CHOICES,
    HOST_WAIT_CHOICES,
    MODE_CHOICES,
    SCHEDULE_CHOICES,
    TRANSPORT_CHOICES,
)

__all__ = [
    "Settings",
    "RingSettings",
    "configure",
    "current_settings",
    "RING_GRAD_ACCUMS",
    "RING_HOST_WAITS",
    "RING_MODES",
    "RING_SCHEDULES",
    "RING_TRANSPORTS",
]

# the --relaymoe-ring-mode / --relaymoe-transport choices (names: relaymoe.options)
RING_MODES = MODE_CHOICES
RING_TRANSPORTS = TRANSPORT_CHOICES
RING_SCHEDULES = SCHEDULE_CHOICES
RING_GRAD_ACCUMS = GRAD_ACCUM_CHOICES
RING_HOST_WAITS = HOST_WAIT_CHOICES


@dataclass(frozen=True)
class Settings:
    mode: str = "auto"
    transport: str = "auto"
    overlap: bool = True
    fused_loss: bool = False
    loss_chunk_tokens: int | None = None  # None: linear_cross_entropy's own choice
    schedule: str = "auto"
    gpus_per_node: int | None = None  # of the cluster; None: the EP ranks' hosts decide
    grad_accum: str = "auto"
    # RELAYMOE_RING_HOST_WAIT for the ring's passes (None: the environment's, else "lag")
    host_wait: str | None = None

    def __post_init__(self):
        if self.mode not in RING_MODES:
            raise ValueError(f"ring mode {self.mode!r} is not one of {RING_MODES}")
        if self.transport not in RING_TRANSPORTS:
            raise ValueError(f"ring transport {self.transport!r} is not one of {RING_TRANSPORTS}")
        if self.schedule not in RING_SCHEDULES:
            raise ValueError(f"ring schedule {self.schedule!r} is not one of {RING_SCHEDULES}")
        if self.grad_accum not in RING_GRAD_ACCUMS:
            raise ValueError(
                f"ring grad_accum {self.grad_accum!r} is not one of {RING_GRAD_ACCUMS}"
            )
        if self.host_wait is not None and self.host_wait not in RING_HOST_WAITS:
            raise ValueError(f"ring host_wait {self.host_wait!r} is not one of {RING_HOST_WAITS}")
        gpn = self.gpus_per_node
        if gpn is not None and (isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1):
            raise ValueError(
                f"gpus_per_node={gpn!r} must be a positive int (the GPUs of one node); fix: pass "
                "--relaymoe-gpus-per-node N with N >= 1, or leave it unset to read the nodes "
                "from the ranks' hosts"
            )
        chunk = self.loss_chunk_tokens
        if chunk is not None and (
            isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
        ):
            raise ValueError(
                f"loss_chunk_tokens={chunk!r} must be a positive int (tokens per chunk of the "
                f"fused output layer + loss); fix: pass --relaymoe-loss-chunk-tokens N with "
                f"N >= 1, or leave it unset for the default"
            )


RingSettings = Settings  # the name the ring dispatcher and older callers use

_OVERRIDE: Settings | None = None
_SET: frozenset[str] = frozenset()  # the fields configure() was given


def configure(
    *,
    mode: str | None = None,
    transport: str | None = None,
    overlap: bool | None = None,
    fused_loss: bool | None = None,
    loss_chunk_tokens: int | None = None,
    schedule: str | None = None,
    gpus_per_node: int | None = None,
    grad_accum: str | None = None,
    host_wait: str | None = None,
) -> Settings:
    """Set relaymoe's settings for models built from now on (each given field overrides the
    Megatron argument of the same name; fields not given keep theirs)."""
    global _OVERRIDE, _SET
    given = {
        "mode": mode,
        "transport": transport,
        "overlap": overlap,
        "fused_loss": fused_loss,
        "loss_chunk_tokens": loss_chunk_tokens,
        "schedule": schedule,
        "gpus_per_node": gpus_per_node,
        "grad_accum": grad_accum,
        "host_wait": host_wait,
    }
    kw = {k: v for k, v in given.items() if v is not None}
    _OVERRIDE = replace(_OVERRIDE or Settings(), **kw)
    _SET = _SET | frozenset(kw)
    return current_settings()


def reset() -> None:
    """Forget ``configure`` (tests)."""
    global _OVERRIDE, _SET
    _OVERRIDE, _SET = None, frozenset()


def _from_megatron_args() -> Settings | None:
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except Exception:  # no training script parsed arguments (library use, tests)
        return None
    if args is None or not hasattr(args, "relaymoe_ring_mode"):
        return None
    return Settings(
        mode=args.relaymoe_ring_mode,
        transport=args.relaymoe_transport,
        overlap=not args.relaymoe_no_overlap,
        fused_loss=bool(getattr(args, "relaymoe_fused_loss", False)),
        loss_chunk_tokens=getattr(args, "relaymoe_loss_chunk_tokens", None),
        schedule=getattr(args, "relaymoe_ring_schedule", "auto"),
        gpus_per_node=getattr(args, "relaymoe_gpus_per_node", None),
        grad_accum=getattr(args, "relaymoe_grad_accum", "auto"),
        host_wait=getattr(args, "relaymoe_ring_host_wait", None),
    )


def current_settings() -> Settings:
    from_args = _from_megatron_args()
    if from_args is None:
        return _OVERRIDE or Settings()
    if _OVERRIDE is None:
        return from_args
    chosen = {f.name: getattr(_OVERRIDE, f.name) for f in fields(Settings) if f.name in _SET}
    return replace(from_args, **chosen)
