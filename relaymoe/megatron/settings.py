"""How the ring runs inside Megatron: mode, transport, overlap (no Megatron import).

Precedence: ``relaymoe.megatron.configure(...)`` > Megatron's parsed arguments
(``--relaymoe-ring-mode``, ``--relaymoe-transport``, ``--relaymoe-no-overlap``, read from
``megatron.training.get_args()`` when a training script parsed them) > defaults
(``auto``/``auto``/overlap on). Read once per ``RingDispatcher`` at model build time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from relaymoe.config import RING_MODE_NAMES, RING_TRANSPORT_NAMES

__all__ = ["RingSettings", "configure", "current_settings", "RING_MODES", "RING_TRANSPORTS"]

RING_MODES = RING_MODE_NAMES  # "auto" and relaymoe.costmodel.MODES
RING_TRANSPORTS = RING_TRANSPORT_NAMES


@dataclass(frozen=True)
class RingSettings:
    mode: str = "auto"
    transport: str = "auto"
    overlap: bool = True

    def __post_init__(self):
        if self.mode not in RING_MODES:
            raise ValueError(f"ring mode {self.mode!r} is not one of {RING_MODES}")
        if self.transport not in RING_TRANSPORTS:
            raise ValueError(f"ring transport {self.transport!r} is not one of {RING_TRANSPORTS}")


_OVERRIDE: RingSettings | None = None


def configure(
    *, mode: str | None = None, transport: str | None = None, overlap: bool | None = None
) -> RingSettings:
    """Set the ring settings for dispatchers built from now on (overrides Megatron args)."""
    global _OVERRIDE
    base = _OVERRIDE or RingSettings()
    kw = {
        k: v
        for k, v in (("mode", mode), ("transport", transport), ("overlap", overlap))
        if v is not None
    }
    _OVERRIDE = replace(base, **kw)
    return _OVERRIDE


def reset() -> None:
    """Forget ``configure`` (tests)."""
    global _OVERRIDE
    _OVERRIDE = None


def _from_megatron_args() -> RingSettings | None:
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except Exception:  # no training script parsed arguments (library use, tests)
        return None
    if args is None or not hasattr(args, "relaymoe_ring_mode"):
        return None
    return RingSettings(
        mode=args.relaymoe_ring_mode,
        transport=args.relaymoe_transport,
        overlap=not args.relaymoe_no_overlap,
    )


def current_settings() -> RingSettings:
    if _OVERRIDE is not None:
        return _OVERRIDE
    return _from_megatron_args() or RingSettings()
