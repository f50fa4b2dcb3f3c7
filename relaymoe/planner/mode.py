"""The planner's view of ``relaymoe.cost``: the mode, transport and schedule the runtime
will use.

The runtime resolves ``mode="auto"`` with ``cost.choose_mode`` over every rank's tokens;
the planner asks the same function with its per-GPU shapes (``T`` MoE input tokens per GPU,
``El = E/EP``, ``I`` already divided by ETP), so ``relaymoe plan`` sizes memory for the mode the
run will take. The schedule (flat or two-level) follows from the GPUs per node
(``parallel.gpus_per_node``) by ``cost.choose_schedule``.
"""

from __future__ import annotations

import dataclasses

from relaymoe import cost, options
from relaymoe.config import Config, ParallelConfig
from relaymoe.planner.memory import Shapes, shapes


def resolve_transport(transport: str, world: int, *, across_nodes: bool = False) -> str:
    """The transport the runtime resolves: ``local`` in a world of one; ``auto`` is the copy
    engine when the EP group lies in one node, and NCCL on every hop when it spans nodes
    (``across_nodes``), in either schedule: the runtime's symmetric memory needs the whole group
    on one host (a transport that pulls inside each node and sends over NCCL across nodes, which
    the simulator's two-level rows assume, is not built)."""
    known = (options.AUTO, *options.TRANSPORTS)  # a request, or an already resolved name
    if transport not in known:
        raise ValueError(f"transport {transport!r}; known: {known}")
    if world == 1:
        return "local"
    if transport == options.AUTO:
        return "nccl" if across_nodes else "copy_engine"
    return transport


def across_nodes(cfg: Config) -> bool:
    """Whether ``cfg``'s EP group spans nodes."""
    return ep_ranks_per_node(cfg.parallel) is not None


def ring_mode(
    cfg_or_shapes: Config | Shapes,
    forced: str | None = None,
    *,
    transport: str | None = None,
    seq: int | None = None,
    mbs: int | None = None,
    ring_only: bool = False,
) -> str:
    """The mode the runtime runs for a config (or for planner shapes): ``forced`` (default: the
    config's ``relaymoe.mode``) unless ``auto``, else ``cost.choose_mode`` (over the
    ring modes only with ``ring_only``). ``transport`` defaults to the config's (``auto`` with
    bare shapes)."""
    if isinstance(cfg_or_shapes, Config):
        cfg = cfg_or_shapes
        sh = shapes(cfg, seq, mbs)
        forced = cfg.relaymoe.mode if forced is None else forced
        transport = cfg.relaymoe.transport if transport is None else transport
        across = across_nodes(cfg)
    else:
        sh, across = cfg_or_shapes, False
    forced = forced or options.AUTO
    if forced not in options.MODE_CHOICES:
        raise ValueError(f"ring mode {forced!r}; known: {options.MODE_CHOICES}")
    if forced != options.AUTO:
        return forced
    return cost.choose_mode_for(
        sh.dims(),
        transport=resolve_transport(transport or options.AUTO, sh.R, across_nodes=across),
        modes=options.RING_MODES if ring_only else options.MODES,
    )


def ring_mode_of(cfg: Config, sh: Shapes, requested: str | None, transport: str) -> str:
    """``requested`` (default: the config's mode) resolved for the shapes ``sh`` of ``cfg``."""
    return ring_mode(sh, requested or cfg.relaymoe.mode, transport=transport)


def per_hop_bytes(sh: Shapes) -> dict[str, dict[str, int]]:
    """Per-hop bytes of the ring modes: ``{mode: {"forward", "backward", "total"}}``."""
    d = sh.dims()
    out = {}
    for mode in options.RING_MODES:
        h = cost.hop_bytes(mode, d)
        out[mode] = {"forward": h.fwd, "backward": h.bwd, "total": h.step}
    return out


def step_report(sh: Shapes, transport: str) -> dict[str, dict[str, float]]:
    """Per mode: link bytes one GPU sends in one layer step and the modelled seconds; for the
    ring modes also ``seconds_captured_hops``, the same with each hop's compute replayed from a
    CUDA graph (``TimeModel.captured_hops``)."""
    d = sh.dims()
    tr = resolve_transport(transport, sh.R)
    captured = cost.DEFAULT_TIME_MODEL.captured_hops()
    out = {}
    for mode in options.MODES:
        b = cost.step_bytes(mode, d)
        out[mode] = {
            "bytes_forward": b.fwd,
            "bytes_backward": b.bwd,
            "seconds": cost.step_seconds(mode, d, transport=tr),
        }
        if mode in options.RING_MODES:
            out[mode]["seconds_captured_hops"] = cost.step_seconds(
                mode, d, transport=tr, model=captured
            )
    return out


def ep_ranks_per_node(par: ParallelConfig) -> int | None:
    """Ranks of an EP group on one node (``None``: the group lies in one node). Megatron lays the
    group over ``ep*etp`` consecutive ranks, members ``etp`` apart (``config`` checks that it
    fills whole nodes when it spans several)."""
    G = par.gpus_per_node
    if G is None or par.ep * par.etp <= G:
        return None
    return max(1, G // par.etp)


def ring_schedule(cfg: Config) -> str:
    """The schedule the ring runs for ``cfg`` (``cost.choose_schedule``)."""
    return cost.choose_schedule(
        world=cfg.parallel.ep, gpus_per_node=ep_ranks_per_node(cfg.parallel)
    )


def hop_time_report(sh: Shapes, mode: str, transport: str, gpus_per_node: int | None) -> dict:
    """Per schedule (``options.SCHEDULES``): the hop times of ``mode`` (a ring mode) in one
    layer step (``cost.ring_hop_times``, fields in seconds, ``step_s`` the layer step) and
    ``layer_peak_bytes``, the layer step's peak over its inputs (``MemoryBytes.peak``: the
    copy engine's shared workspace excluded)."""
    d = sh.dims()
    tr = resolve_transport(transport, sh.R)
    # the same buffers in any order
    peak = cost.memory_bytes(mode, d, transport=tr, main_grads=sh.wgrad_fusion).peak
    out = {}
    for sched in options.SCHEDULES:
        t = cost.ring_hop_times(mode, d, schedule=sched, gpus_per_node=gpus_per_node, transport=tr)
        out[sched] = {"mode": mode, **dataclasses.asdict(t), "nodes": t.nodes, "step_s": t.step_s,
                      "layer_peak_bytes": peak}  # fmt: skip
    if mode == "expert":  # asked for by name only: reported, never chosen (not yet measured)
        t = cost.node_batched_hop_times(d, gpus_per_node=gpus_per_node)
        mem = cost.node_batched_memory_bytes(d, gpus_per_node=gpus_per_node or sh.R,
                                             main_grads=sh.wgrad_fusion)  # fmt: skip
        out[options.NODE_BATCHED] = {
            "mode": mode, **dataclasses.asdict(t), "nodes": t.nodes, "step_s": t.step_s,
            "layer_peak_bytes": mem.peak,  # NCCL: its exchanges are batch_isend_irecv
        }  # fmt: skip
    return out
