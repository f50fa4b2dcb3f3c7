"""The planner's view of ``relaymoe.costmodel``: the mode and transport the runtime will use.

The runtime resolves ``mode="auto"`` with ``costmodel.choose_mode`` over every rank's tokens;
the planner asks the same function with its per-GPU shapes (``T`` MoE input tokens per GPU,
``El = E/EP``, ``I`` already divided by ETP), so ``relaymoe plan`` sizes memory for the mode the
run will take.
"""

from __future__ import annotations

from relaymoe import costmodel
from relaymoe.config import Config
from relaymoe.planner.memory import PROB_BYTES, Shapes, shapes


def resolve_transport(transport: str, world: int) -> str:
    """The transport the runtime resolves: ``local`` in a world of one; ``auto`` is the copy
    engine (assumption: the EP group lies within one node with symmetric memory, where the
    runtime's ``auto`` takes it; name ``nccl`` in the config otherwise)."""
    known = (costmodel.AUTO, *costmodel.TRANSPORTS)  # a request, or an already resolved name
    if transport not in known:
        raise ValueError(f"transport {transport!r}; known: {known}")
    if world == 1:
        return "local"
    if transport == costmodel.AUTO:
        return "copy_engine"
    return transport


def ring_mode(
    cfg_or_shapes: Config | Shapes,
    forced: str | None = None,
    *,
    transport: str | None = None,
    seq: int | None = None,
    mbs: int | None = None,
) -> str:
    """The mode the runtime runs for a config (or for planner shapes): ``forced`` (default: the
    config's ``relaymoe.ring_mode``) unless ``auto``, else ``costmodel.choose_mode``.
    ``transport`` defaults to the config's (``auto`` with bare shapes)."""
    if isinstance(cfg_or_shapes, Config):
        cfg = cfg_or_shapes
        sh = shapes(cfg, seq, mbs)
        forced = cfg.relaymoe.ring_mode if forced is None else forced
        transport = cfg.relaymoe.transport if transport is None else transport
    else:
        sh = cfg_or_shapes
    forced = forced or costmodel.AUTO
    if forced not in costmodel.MODE_CHOICES:
        raise ValueError(f"ring mode {forced!r}; known: {costmodel.MODE_CHOICES}")
    if forced != costmodel.AUTO:
        return forced
    return costmodel.choose_mode(
        tokens=sh.T,
        hidden=sh.h,
        ffn=sh.I,
        num_local_experts=sh.El,
        topk=sh.K,
        world=sh.R,
        act_bytes=sh.e,
        prob_bytes=PROB_BYTES,
        transport=resolve_transport(transport or costmodel.AUTO, sh.R),
    )


def ring_mode_of(cfg: Config, sh: Shapes, requested: str | None, transport: str) -> str:
    """``requested`` (default: the config's mode) resolved for the shapes ``sh`` of ``cfg``."""
    return ring_mode(sh, requested or cfg.relaymoe.ring_mode, transport=transport)


def per_hop_bytes(sh: Shapes) -> dict[str, dict[str, int]]:
    """Per-hop bytes of the ring modes: ``{mode: {"forward", "backward", "total"}}``."""
    d = sh.dims()
    out = {}
    for mode in costmodel.RING_MODES:
        h = costmodel.hop_bytes(mode, d)
        out[mode] = {"forward": h.fwd, "backward": h.bwd, "total": h.step}
    return out


def step_report(sh: Shapes, transport: str) -> dict[str, dict[str, float]]:
    """Per mode: link bytes one GPU sends in one layer step and the modelled seconds."""
    d = sh.dims()
    tr = resolve_transport(transport, sh.R)
    out = {}
    for mode in costmodel.MODES:
        b = costmodel.step_bytes(mode, d)
        out[mode] = {
            "bytes_forward": b.fwd,
            "bytes_backward": b.bwd,
            "seconds": costmodel.step_seconds(mode, d, transport=tr),
        }
    return out
