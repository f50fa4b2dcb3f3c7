"""relaymoe's settings in Megatron: the ring's options and the fused loss (no Megatron import).

:class:`Settings` is :class:`relaymoe.options.RingOptions` (the one schema of the ring's
options: its fields are the flags ``--relaymoe-<name>``) plus the fused loss. Precedence, field
by field: ``relaymoe.megatron.configure(...)`` > Megatron's parsed arguments (read from
``megatron.training.get_args()`` when a training script parsed them) > this process's options
(``relaymoe.options.defaults()``: the ``RELAYMOE_*`` environment, installed by ``register()``)
> the defaults. Read once per model part at build time: the ring settings by each
``RingDispatcher``, the loss settings by each ``GPTModel``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from relaymoe import options
from relaymoe.options import RingOptions

__all__ = ["Settings", "args_settings", "configure", "current_settings", "reset"]


@dataclass(frozen=True)
class Settings(RingOptions):
    """The ring's options (``RingOptions``' fields) and the fused output layer + loss."""

    fused_loss: bool = False
    loss_chunk_tokens: int | None = None  # None: linear_cross_entropy's own choice

    def __post_init__(self):
        chunk = self.loss_chunk_tokens
        if chunk is not None and (
            isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
        ):
            raise ValueError(
                f"loss_chunk_tokens={chunk!r} must be a positive int (tokens per chunk of the "
                f"fused output layer + loss); fix: pass --relaymoe-loss-chunk-tokens N with "
                f"N >= 1, or leave it unset for the default"
            )
        super().__post_init__()

    @property
    def ring(self) -> RingOptions:
        """These settings as the ring's options (what ``ring_moe`` and the process take)."""
        names = {f.name for f in dataclasses.fields(RingOptions)}
        return RingOptions(**{n: getattr(self, n) for n in names})


def _base() -> Settings:
    """The process's options as settings (the fused loss off)."""
    ring = options.defaults()
    return Settings(**{f.name: getattr(ring, f.name) for f in dataclasses.fields(RingOptions)})


_OVERRIDE: dict = {}  # the fields configure() was given


def configure(**fields) -> Settings:
    """Set relaymoe's settings for models built from now on: any field of :class:`Settings`
    (the ring's options, ``fused_loss``, ``loss_chunk_tokens``); each overrides the Megatron
    argument of the same name, fields not given keep theirs. Unknown names raise."""
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"configure(): unknown settings {unknown}; known: {sorted(known)}")
    candidate = {**_OVERRIDE, **{k: v for k, v in fields.items() if v is not None}}
    replace(_base(), **candidate)  # validate before keeping anything
    _OVERRIDE.clear()
    _OVERRIDE.update(candidate)
    return current_settings()


def reset() -> None:
    """Forget ``configure`` (tests)."""
    _OVERRIDE.clear()


def args_settings(args) -> Settings:
    """The settings Megatron's parsed ``args`` give (on top of the process's options): each
    ``--relaymoe-<field>`` flag, the fused loss."""
    base = _base()
    given = {}
    for flag, f in options.megatron_flags():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            given[f.name] = value
    given["fused_loss"] = bool(getattr(args, "relaymoe_fused_loss", False))
    given["loss_chunk_tokens"] = getattr(args, "relaymoe_loss_chunk_tokens", None)
    return replace(base, **given)


def _from_megatron_args() -> Settings | None:
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except Exception:  # no training script parsed arguments (library use, tests)
        return None
    if args is None or not hasattr(args, "relaymoe_mode"):
        return None
    return args_settings(args)


def current_settings() -> Settings:
    """The settings for a model built now (see the module doc for the precedence)."""
    settings = _from_megatron_args() or _base()
    return replace(settings, **_OVERRIDE) if _OVERRIDE else settings
