"""relaymoe's configuration inside Megatron, built once and handed to what uses it (no Megatron
import).

Two objects: the ring's :class:`relaymoe.options.RingConfig` (its flagged fields are the flags
``--relaymoe-<name>``) and :class:`FusedLoss` (``--relaymoe-fused-loss``,
``--relaymoe-loss-chunk-tokens``). Where a model gets them, whole objects, never field by field:

1. the caller's value: objects attached to the model's ``TransformerConfig`` by
   :func:`configure` (a Python caller building a model without Megatron's parser), else those
   Megatron's parsed arguments carry: ``args.relaymoe_ring``, built once by the patched
   ``validate_args`` from the flags over the ``RELAYMOE_*`` environment (the entry point, the one
   place the environment is read: ``relaymoe.options.from_env``), or from the flags alone where
   arguments were parsed without it;
2. else the documented defaults (``RingConfig()``, the fused loss off).

Read once per model part at build time: the ring's by each ``RingDispatcher`` (which keeps it,
with its own ``RingRuntime``), the loss's by each ``GPTModel``. Nothing here is process state.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaymoe import options
from relaymoe.options import RingConfig

__all__ = [
    "ARGS_ATTR",
    "FusedLoss",
    "configure",
    "fused_loss_from_args",
    "fused_loss_of",
    "ring_config_from_args",
    "ring_config_of",
]

# where the objects live: on Megatron's parsed arguments (ARGS_ATTR) and on a TransformerConfig
ARGS_ATTR = "relaymoe_ring"
CONFIG_RING = "relaymoe_ring"
CONFIG_LOSS = "relaymoe_fused_loss"


@dataclass(frozen=True)
class FusedLoss:
    """``GPTModel``'s output layer + loss through ``relaymoe.linear_cross_entropy``
    (``enabled``), in chunks of ``chunk_tokens`` tokens (None: its own choice)."""

    enabled: bool = False
    chunk_tokens: int | None = None

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ValueError(f"FusedLoss.enabled={self.enabled!r} must be True or False")
        chunk = self.chunk_tokens
        if chunk is not None and (
            isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
        ):
            raise ValueError(
                f"loss_chunk_tokens={chunk!r} must be a positive int (tokens per chunk of the "
                f"fused output layer + loss); fix: pass --relaymoe-loss-chunk-tokens N with "
                f"N >= 1, or leave it unset for the default"
            )


def ring_config_from_args(args, base: RingConfig | None = None) -> RingConfig:
    """The ``RingConfig`` Megatron's parsed ``args`` give: ``base`` (default ``RingConfig()``;
    the entry point passes ``relaymoe.options.from_env()``) with each ``--relaymoe-<field>``
    flag that was given (not None) applied."""
    given = {}
    for flag, f in options.megatron_flags():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            given[f.name] = value
    return options.with_flags(base or RingConfig(), given)


def fused_loss_from_args(args) -> FusedLoss:
    """The fused loss Megatron's parsed ``args`` ask for."""
    return FusedLoss(
        bool(getattr(args, "relaymoe_fused_loss", False)),
        getattr(args, "relaymoe_loss_chunk_tokens", None),
    )


def configure(config, *, ring: RingConfig | None = None, fused_loss: FusedLoss | None = None):
    """Attach ``ring`` and ``fused_loss`` to ``config`` (a ``TransformerConfig``): the models
    built from it use them instead of the parsed arguments' (each given object replaces its
    kind whole). Returns ``config``."""
    if ring is not None and not isinstance(ring, RingConfig):
        raise ValueError(f"configure(ring={ring!r}): pass a relaymoe.options.RingConfig")
    if fused_loss is not None and not isinstance(fused_loss, FusedLoss):
        raise ValueError(
            f"configure(fused_loss={fused_loss!r}): pass a relaymoe.megatron.settings.FusedLoss"
        )
    if ring is not None:
        setattr(config, CONFIG_RING, ring)
    if fused_loss is not None:
        setattr(config, CONFIG_LOSS, fused_loss)
    return config


def _megatron_args():
    """Megatron's parsed arguments where a training script parsed them with relaymoe's flags,
    else None (library use, tests)."""
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except Exception:  # no training script parsed arguments
        return None
    if args is None or not hasattr(args, "relaymoe_mode"):
        return None
    return args


def ring_config_of(config) -> RingConfig:
    """The ``RingConfig`` of a model built from ``config`` (a ``TransformerConfig``; see the
    module doc for where it comes from)."""
    attached = getattr(config, CONFIG_RING, None)
    if attached is not None:
        return attached
    args = _megatron_args()
    if args is None:
        return RingConfig()
    built = getattr(args, ARGS_ATTR, None)
    return built if isinstance(built, RingConfig) else ring_config_from_args(args)


def fused_loss_of(config) -> FusedLoss:
    """The fused loss of a model built from ``config`` (see the module doc)."""
    attached = getattr(config, CONFIG_LOSS, None)
    if attached is not None:
        return attached
    args = _megatron_args()
    return FusedLoss() if args is None else fused_loss_from_args(args)
