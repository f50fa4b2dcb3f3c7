"""Peak memory per pipeline stage and the greedy selective-recompute planner (paper §3.4).

Baseline: every layer fully recomputed (Megatron ``recompute_granularity=full``), the MoE block
following its dispatcher's schedule. Option ``keep`` for layer ``i`` retains that layer's
activations instead: memory cost ``m_i`` (kept activations minus the checkpointed input, times
the microbatches in flight) and compute saving ``c_i`` (the forward FLOPs the backward no longer
replays: the attention block; with alltoall also the MoE experts, which a kept Megatron layer no
longer recomputes, whereas the ring still reconstructs per hop). Budget = usable capacity minus
the peak under full recompute; options are taken by ``c/m``, best first, while they fit (a
prefix of the ranking, so a larger budget never recomputes more layers).

Stage peak = model states + retained activations (every in-flight microbatch's kept layers and
checkpointed inputs) + the larger transient: the backward of one layer (a recomputed layer's
rematerialised activations and MoE working set; for a kept layer only what its backward adds
beyond its retained activations) or, on the last stage, the loss's forward: the final norm
and Megatron's logits + cross-entropy buffers, or the fused loss's chunk and kept gradients
(``relaymoe.lossmodel``), whose backward only consumes what its forward made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from relaymoe.config import Config
from relaymoe.planner import memory as mm
from relaymoe.planner.mode import across_nodes, resolve_transport, ring_mode_of


@dataclass(frozen=True)
class LayerOption:
    layer: int
    option: str  # "keep_attention" (full attention) or "keep_linear_attention" (gated delta net)
    mem_bytes: int  # m: extra bytes on this stage when kept
    flops_saved: float  # c: per microbatch


@dataclass(frozen=True)
class RecomputePlan:
    dispatcher: str
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    recompute_modules: tuple[str, ...] | None
    recomputed_layers: tuple[int, ...]  # global layer indices recomputed on every stage
    kept_layers: tuple[int, ...]
    budget_bytes: int
    used_bytes: int
    flops_saved_per_microbatch: float
    megatron_expressible: bool  # False: per-layer choices beyond Megatron's block method

    def megatron_overrides(self) -> dict:
        return {
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
            "recompute_modules": list(self.recompute_modules) if self.recompute_modules else None,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("recomputed_layers", "kept_layers", "recompute_modules"):
            d[k] = list(d[k]) if d[k] is not None else None
        return d


@dataclass(frozen=True)
class StagePeak:
    stage: int
    total: int
    terms: dict


def stage_peak(
    cfg: Config,
    stage: int,
    dispatcher: str,
    kept: frozenset[int] = frozenset(),
    *,
    seq: int | None = None,
    mbs: int | None = None,
    ring_mode: str | None = None,
    transport: str | None = None,
    logits: bool = True,
    fused_loss: bool | None = None,
    capture_hops: bool = False,
    recompute_modules: tuple[str, ...] | None = None,
    transformer_impl: str = mm.TE_IMPL,
) -> StagePeak:
    """Peak bytes of one pipeline stage's GPU; ``kept`` layers are not recomputed.
    ``recompute_modules``: megatron-core's selective recompute of these modules on every layer
    (``--recompute-granularity selective``; ``kept`` is then moot), under ``transformer_impl``
    (``memory.selective_layer_bytes``).
    ``ring_mode`` / ``transport``: default the config's; ``auto`` is what the runtime picks
    at this sequence length and micro-batch (``relaymoe.planner.ring_mode``). ``fused_loss``:
    the last stage runs ``relaymoe.linear_cross_entropy`` (default the config's
    ``relaymoe.fused_loss``); ``logits=False`` leaves the loss phase out altogether.
    ``capture_hops``: the ring's recorded hop bodies hold their static buffers (once per GPU,
    ``captured_hop_bytes``)."""
    sh = mm.shapes(cfg, seq, mbs)
    states = mm.model_state_bytes(cfg, stage)
    layers = mm.stage_layers(cfg, stage)
    inflight = mm.inflight_microbatches(cfg, stage)
    workspace = captured = 0
    if dispatcher == "ring":
        tr = resolve_transport(
            transport or cfg.relaymoe.transport, sh.R, across_nodes=across_nodes(cfg)
        )
        ring_mode = ring_mode_of(cfg, sh, ring_mode, tr)
        moe_peak = mm.moe_peak_ring(sh, ring_mode, tr)
        # persistent and shared by all layers: once per GPU, beside the layers' peaks
        workspace = mm.symmetric_workspace_bytes(sh, ring_mode, tr)
        if capture_hops:  # 0 for alltoall mode (no hops)
            captured = mm.captured_hop_bytes(sh, ring_mode)
    else:
        moe_peak = mm.moe_peak_alltoall(sh)
    # Per layer: r = what it retains through the forward (all its activations when kept, its
    # input when recomputed) and x = what its backward adds on top of r. A recomputed layer
    # rematerialises everything but the checkpointed input it already holds, and its MLP
    # block peaks at max(moe_peak, inner keep) over the norm's output. A kept layer holds its
    # activations in r already (the alltoall's dispatched tokens and expert intermediates are
    # part of both moe_peak and its inner keep), so its backward adds only the rest of the MoE
    # peak, or the attention gradients. Adding a full rematerialised layer on top of kept
    # layers would count them twice (a measured two-layer peak is the loss phase: retained +
    # final norm + logits).
    r, x = [], []
    for i in layers:
        if recompute_modules is not None:
            ri, xi = mm.selective_layer_bytes(
                cfg, sh, i, dispatcher, ring_mode, moe_peak, frozenset(recompute_modules),
                transformer_impl,
            )  # fmt: skip
        else:
            ri, xi = layer_bytes(cfg, sh, i, dispatcher, ring_mode, moe_peak, i in kept)
        r.append(ri)
        x.append(xi)
    per_mb = sum(r)
    retained = int(inflight * per_mb)
    # backward of layer j of the newest microbatch: the other in-flight microbatches keep all,
    # this one keeps layers up to j (the later ones are done), plus j's extra
    others = max(inflight - 1, 0) * per_mb
    ws, acc = 0, 0
    for rj, xj in zip(r, x, strict=True):
        acc += rj
        ws = max(ws, int(others + acc + xj) - retained)
    if fused_loss is None:
        fused_loss = cfg.relaymoe.fused_loss
    # The loss peaks in its forward, after the last layer's forward and before any backward:
    # on top of what the stage retains, as the layers' backward working set is.
    loss = 0
    if stage == cfg.parallel.pp - 1 and logits:
        loss = mm.final_norm_bytes(cfg, sh) + mm.loss_bytes(cfg, sh, fused_loss)
    transient = max(ws, loss)
    terms = {
        **states,
        "activations_retained": retained,
        "layer_working_set": ws,
        "moe_block_peak": moe_peak,
        "symmetric_workspace": workspace,
        "captured_hop_buffers": captured,
        "logits_loss": loss,
    }
    total = sum(states.values()) + workspace + captured + retained + transient
    return StagePeak(stage=stage, total=total, terms=terms)


def layer_bytes(
    cfg: Config,
    sh: mm.Shapes,
    layer: int,
    dispatcher: str,
    ring_mode: str,
    moe_peak: int,
    kept: bool,
) -> tuple[int, int]:
    """``(r, x)`` of one layer, fully recomputed or kept (``stage_peak``'s comment says why)."""
    attn = mm.attention_keep_bytes(cfg, sh, layer)
    norm = mm.mlp_norm_keep_bytes(cfg, sh)
    inner = mm.mlp_inner_keep_bytes(cfg, sh, layer, dispatcher, ring_mode)
    peak = max(moe_peak, inner) if cfg.model.moe_layer_pattern[layer] else inner
    if kept:
        return attn + norm + inner, max(
            peak - inner, mm.attention_backward_transient_bytes(cfg, sh, layer)
        )
    inp = mm.layer_input_bytes(sh)
    return inp, attn + norm + peak - inp


# The terms of a stage's peak that grow with the sequence, in ``StagePeak.terms``' names: what a
# longer sequence runs out of. The model states (params, grads, optimizer) are fixed; the MoE
# block's peak is part of the layer working set. ``benchmarks/max_seq.py`` names its measured
# breakdown the same way.
SEQUENCE_TERMS = ("activations_retained", "layer_working_set", "logits_loss")
MODEL_STATE_TERMS = ("params", "grads", "optimizer")


def comparable_terms(terms: dict) -> dict:
    """A stage peak's ``terms`` in the measured breakdown's names: ``model_states`` (params,
    grads and optimizer together, what the allocator holds before a step's forward), the
    ``SEQUENCE_TERMS``, and ``persistent_buffers`` (the ring's symmetric workspace and recorded
    hop buffers)."""
    out = {"model_states": sum(terms.get(k, 0) for k in MODEL_STATE_TERMS)}
    out.update({k: terms.get(k) for k in SEQUENCE_TERMS})
    out["persistent_buffers"] = terms.get("symmetric_workspace", 0) + terms.get(
        "captured_hop_buffers", 0
    )
    return out


def binding_term(terms: dict) -> str | None:
    """The largest of the ``SEQUENCE_TERMS`` in ``terms`` (None or absent ones left out): the
    term that binds the longest sequence. None when none is known."""
    known = [(terms[k], k) for k in SEQUENCE_TERMS if terms.get(k) is not None]
    return max(known)[1] if known else None


def worst_stage_peak(cfg: Config, dispatcher: str, kept=frozenset(), **kw) -> StagePeak:
    stages = sorted({0, cfg.parallel.pp - 1})
    return max((stage_peak(cfg, s, dispatcher, kept, **kw) for s in stages), key=lambda p: p.total)


def layer_options(cfg: Config, dispatcher: str, stage: int, **kw) -> list[LayerOption]:
    kw.pop("logits", None)
    kw.pop("fused_loss", None)
    kw.pop("capture_hops", None)
    sh = mm.shapes(cfg, kw.get("seq"), kw.get("mbs"))
    mode = "expert"
    if dispatcher == "ring":
        tr = resolve_transport(
            kw.get("transport") or cfg.relaymoe.transport,
            sh.R,
            across_nodes=across_nodes(cfg),
        )
        mode = ring_mode_of(cfg, sh, kw.get("ring_mode"), tr)
    inflight = mm.inflight_microbatches(cfg, stage)
    out = []
    for i in mm.stage_layers(cfg, stage):
        keep = mm.attention_keep_bytes(cfg, sh, i)
        keep += mm.moe_keep_bytes(cfg, sh, i, dispatcher, mode)
        m = int(inflight * (keep - mm.layer_input_bytes(sh)))
        c = mm.attention_flops(cfg, sh, i)
        if dispatcher != "ring" and cfg.model.moe_layer_pattern[i]:
            c += 2 * sh.P * sh.h * (sh.J + sh.I)  # experts' forward no longer replayed
        full = cfg.model.attention_layer_pattern[i]
        out.append(LayerOption(i, "keep_attention" if full else "keep_linear_attention", m, c))
    return out


def plan_recompute(
    cfg: Config, dispatcher: str, usable_bytes: int, *, ring_mode: str | None = None, **kw
) -> RecomputePlan:
    """Greedy c/m selection on every pipeline stage; raises ValueError when even full
    recompute does not fit."""
    p = cfg.parallel
    per_stage_kept: dict[int, list[int]] = {}
    budget_min = None
    used_max = 0
    saved = 0.0
    for stage in range(p.pp):
        base = stage_peak(cfg, stage, dispatcher, ring_mode=ring_mode, **kw).total
        budget = usable_bytes - base
        if budget < 0:
            fused = kw.get("fused_loss")
            fused = cfg.relaymoe.fused_loss if fused is None else fused
            loss = " and the fused loss" if fused else ""
            raise ValueError(
                f"{cfg.name or 'config'} does not fit with {dispatcher} even with full "
                f"recompute{loss}: stage {stage} needs {gib(base)} GiB, usable "
                f"{gib(usable_bytes)} GiB per GPU; raise tp/cp/pp/ep, lower seq_length or "
                "micro_batch_size, or use a larger GPU"
            )
        opts = sorted(
            layer_options(cfg, dispatcher, stage, ring_mode=ring_mode, **kw),
            key=lambda o: (-(o.flops_saved / max(o.mem_bytes, 1)), o.layer),
        )
        kept, used, c = [], 0, 0.0
        for o in opts:
            if used + o.mem_bytes > budget:
                break
            kept.append(o.layer)
            used += o.mem_bytes
            c += o.flops_saved
        # the layer working set may grow when the kept layers' activations are resident:
        # verify the whole stage and drop the least valuable kept layers until it fits.
        while kept:
            peak = stage_peak(cfg, stage, dispatcher, frozenset(kept), ring_mode=ring_mode, **kw)
            if peak.total <= usable_bytes:
                break
            kept.pop()
        per_stage_kept[stage] = kept
        budget_min = budget if budget_min is None else min(budget_min, budget)
        used_max = max(used_max, used)
        if stage == 0:
            saved = c
    return _to_megatron(cfg, dispatcher, per_stage_kept, budget_min or 0, used_max, saved)


def _to_megatron(cfg, dispatcher, per_stage_kept, budget, used, saved) -> RecomputePlan:
    """Megatron's block method recomputes the first N layers of each stage; N must be the same
    on all stages, so the stage that can keep the fewest layers decides."""
    p = cfg.parallel
    per_stage = cfg.model.num_layers // p.pp
    n_keep = min(len(k) for k in per_stage_kept.values())
    n_recompute = per_stage - n_keep
    recomputed, kept = [], []
    expressible = True
    for stage in range(p.pp):
        layers = mm.stage_layers(cfg, stage)
        chosen = set(sorted(per_stage_kept[stage], key=layers.index)[:n_keep])
        block_kept = set(layers[per_stage - n_keep :]) if n_keep else set()
        if p.vpp and p.vpp > 1 and n_keep:
            expressible = False
        if chosen != block_kept:
            # identical layers: Megatron's choice (the last ones) is as good; otherwise the
            # per-layer list is the plan and Megatron's flags only approximate it
            if _signature(cfg, chosen) != _signature(cfg, block_kept):
                expressible = False
            else:
                chosen = block_kept
        kept += sorted(chosen)
        recomputed += [i for i in layers if i not in chosen]
    if n_recompute == 0:
        gran = method = num = None
    else:
        gran, method, num = "full", "block", n_recompute
    return RecomputePlan(
        dispatcher=dispatcher,
        recompute_granularity=gran,
        recompute_method=method,
        recompute_num_layers=num,
        recompute_modules=None,
        recomputed_layers=tuple(sorted(recomputed)),
        kept_layers=tuple(sorted(kept)),
        budget_bytes=int(budget),
        used_bytes=int(used),
        flops_saved_per_microbatch=float(saved),
        megatron_expressible=expressible,
    )


def _signature(cfg: Config, layers) -> list:
    m = cfg.model
    return sorted((m.attention_layer_pattern[i], m.moe_layer_pattern[i]) for i in layers)


def gib(x: float) -> str:
    return f"{x / 2**30:.2f}"
