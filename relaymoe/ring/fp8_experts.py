"""``ring_moe(..., fp8=state)``: the expert ring with fp8 GEMMs, the experts' fp8 copies
travelling instead of their bf16 weights.

Expert mode only (``mode="auto"`` resolves to it; the others are refused, :func:`fp8_ring_config`).
Per call:

* the rank's own experts come quantised from the layer's ``relaymoe.Fp8State`` (e4m3 in their
  own layouts ``w13 (El, J, H)``, ``w2 (El, H, I)`` with their inverse scales; quantised once
  per optimizer step, the state's cache), and x is quantised once (``quantize_input``), not once
  a hop: one scale and one delayed-scaling history entry for every range;
* each hop's lead is :func:`fp8_layout`: the fp8 weights in the forward layouts and their
  scales, ``W`` bytes plus ``4*El*2`` (tensor-scaled) or ``4*El*(J*H + H*I)/128^2`` (blockwise)
  against the bf16 ring's ``2*W``; forward reads only these layouts, the backward builds the
  transposed copies its dgrad reads (``w13_t``, ``w2_t``) on arrival, one device pass over the
  lead's ``W`` bytes, instead of sending them;
* the weight gradients trail in the accumulators' dtype as in the bf16 ring (``grad_accum``).

What scales the intermediates (``a``, ``dh``, ``pa``) get: current scaling, one per hop (the
hop's expert range), where ``moe_experts(fp8=...)`` takes one over all experts; delayed
scaling, the role's current scale at every hop and one history entry per pass
(:class:`OncePerPass`), as one call; blockwise, the same values. Not supported here (refused):
biases, CUDA-graph capture, node-batched rounds, token and all-to-all modes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaymoe.fp8_state import Fp8State, check_fp8_call
from relaymoe.kernels.experts import HopOptions
from relaymoe.kernels.fp8.hop import Fp8Saved, fp8_hop_backward, fp8_hop_forward, quantize_input
from relaymoe.kernels.fp8.weights import Fp8ExpertWeights
from relaymoe.options import NODE_BATCHED, RingConfig
from relaymoe.ring.executor import PassWork, ring_pass
from relaymoe.ring.plan import IDX, Layout, RingProblem, capacity, ring_plan, weights_layout
from relaymoe.ring.weights import FORWARD, LocalExperts, home_grads, hop_grads
from relaymoe.routing import build_routing_index

__all__ = ["OncePerPass", "fp8_layout", "fp8_ring_config", "fp8_ring_moe"]


def fp8_ring_config(config: RingConfig, state, *, x, w2, backend: str, capturable: bool,
                    b13, b2) -> RingConfig:  # fmt: skip
    """``config`` with ``mode="auto"`` resolved to expert mode, after refusing what the fp8 ring
    cannot run (``ValueError`` naming the value and the fix): a ``state`` that is not an
    ``Fp8State``, another mode, node-batched rounds, CUDA-graph capture, and what
    ``check_fp8_call`` refuses (device, dtype, biases, blockwise sizes)."""
    if not isinstance(state, Fp8State):
        raise ValueError(
            f"ring_moe(fp8={state!r}): pass a relaymoe.Fp8State (the layer keeps one across "
            "calls: its fp8 weights are quantised once per optimizer step), or None"
        )
    if config.mode not in ("auto", "expert"):
        raise ValueError(
            f"ring_moe(fp8=...) runs in expert mode only; RingConfig.mode={config.mode!r}: use "
            "mode='expert' or 'auto', or fp8=None (--relaymoe-fp8-experts off)"
        )
    if config.schedule == NODE_BATCHED:
        raise ValueError(
            "ring_moe(fp8=...) does not run node-batched rounds (schedule='node_batched'); use "
            "schedule='auto', 'flat' or 'two_level', or fp8=None"
        )
    if capturable:
        raise ValueError(
            "ring_moe(fp8=..., capturable=True): the fp8 ring is not captured in CUDA graphs "
            "yet (its hops size their buffers from exact pair counts, a host sync); drop the "
            "CUDA-graph flags, or run the experts in bf16 (--relaymoe-fp8-experts off)"
        )
    w2_one = w2 if isinstance(w2, Tensor) else w2[0][None]
    check_fp8_call(state, x, w2_one, w2_one, backend=backend, b13=b13, b2=b2)
    return config if config.mode == "expert" else config.replace(mode="expert")


def fp8_layout(problem: RingProblem, wq: Fp8ExpertWeights) -> Layout:
    """A travelling fp8 partition: ``w13`` and ``w2`` in e4m3 (their forward layouts) and their
    inverse scales (fp32; per expert, or per 128x128 block)."""
    return Layout.of(("w13", wq.w13.dtype, tuple(wq.w13.shape)),
                     ("inv13", torch.float32, tuple(wq.inv13.shape)),
                     ("w2", wq.w2.dtype, tuple(wq.w2.shape)),
                     ("inv2", torch.float32, tuple(wq.inv2.shape)))  # fmt: skip


def _visiting(lead: dict[str, Tensor], own: Fp8ExpertWeights, transposed: bool):
    """The visiting partition's fp8 weights from its lead views (``transposed``: with the
    dgrad layouts built here, a copy of the lead)."""
    t = (lambda w: w.transpose(1, 2).contiguous()) if transposed else (lambda w: None)
    return Fp8ExpertWeights(lead["w13"], t(lead["w13"]), lead["inv13"], lead["w2"],
                            t(lead["w2"]), lead["inv2"], own.blockwise, own.dtype)  # fmt: skip


def _own_weights(state: Fp8State, experts: LocalExperts, ws) -> Fp8ExpertWeights:
    """This rank's fp8 experts in expert order: the state's copy, quantised again only when the
    weights changed (the per-expert lists are stacked only then)."""
    originals = (experts.w13, experts.w2)
    hit = state.cached(originals)
    if hit is not None:
        return hit
    w13, w2, _ = experts.stacked(FORWARD)
    return state.expert_weights(w13, w2, originals)


def _hop_pairs(index, El: int, R: int) -> list[int]:
    """Each partition's pair count of this rank's tokens (one host sync a call: the fp8 hops
    recompute h from the saved fp8 x, which needs exact counts)."""
    offs = index.expert_token_offsets[::El][: R + 1].tolist() if El else [0] * (R + 1)
    return [offs[p + 1] - offs[p] for p in range(R)]


class OncePerPass:
    """The scale source a pass's hops quantise ``a``, dh and p*a with: under delayed scaling
    every hop gets the role's current scale and the pass records one history entry per role
    (the largest amax of its hops, :meth:`flush`), as one call over all experts would, instead
    of one per hop (R per pass); any other source is asked directly."""

    def __init__(self, scales):
        self.scales = scales
        self.delayed = hasattr(scales, "history")
        self.seen: dict[str, tuple[Tensor, str]] = {}

    def scale(self, role: str, amax: Tensor, fmt: str) -> Tensor:
        if not self.delayed:
            return self.scales.scale(role, amax, fmt)
        amax = amax.detach().float().reshape(1)
        old = self.seen.get(role)
        self.seen[role] = (amax if old is None else torch.maximum(old[0], amax), fmt)
        used = self.scales.scales.get(role)
        return used if used is not None else torch.ones(1, device=amax.device)

    def flush(self) -> None:
        for role, (amax, fmt) in self.seen.items():
            self.scales.scale(role, amax, fmt)
        self.seen.clear()


class _Fp8Call:
    """What one fp8 ring call's passes share."""

    def __init__(self, problem, call, state, wq, index, x, probs, x_fp8):
        self.problem, self.call, self.state, self.wq = problem, call, state, wq
        self.index, self.x, self.probs, self.x_fp8 = index, x, probs, x_fp8
        El, R = problem.num_local_experts, problem.world_size
        self.pairs = _hop_pairs(index, El, R)
        self.layout = fp8_layout(problem, wq)
        lead = [self.layout.nbytes] * R
        self.fwd = ring_plan(problem, lead, None)
        self.bwd = ring_plan(problem, lead, [weights_layout(problem, "d").nbytes] * R)

    def options(self, part: int) -> HopOptions:
        return HopOptions(backend="triton", kernels=self.call.kernel_choice.kernels,
                          activation=self.problem.activation, n_pairs=self.pairs[part])  # fmt: skip

    def own_lead(self) -> dict[str, Tensor]:
        w = self.wq
        return {"w13": w.w13, "inv13": w.inv13, "w2": w.w2, "inv2": w.inv2}

    def forward(self) -> Tensor:
        p, s, El, x = self.problem, self.state, self.problem.num_local_experts, self.x
        out = torch.zeros_like(x)

        scales = OncePerPass(s.scales)

        def compute(hop, part, lead, trail):
            if x.shape[0] == 0:
                return
            w = self.wq if lead is None else _visiting(lead, self.wq, transposed=False)
            fp8_hop_forward(x, w, self.probs, self.index, part * El, (part + 1) * El, out, False,
                            recipe=s.recipe, scales=scales, options=self.options(part),
                            x_fp8=self.x_fp8)  # fmt: skip

        work = PassWork(lead_layout=lambda q: self.layout, own_lead=self.own_lead(),
                        compute=compute, capacity=capacity(self.fwd, self.bwd, p))  # fmt: skip
        ring_pass(p, self.call, x.device, "fwd", self.fwd, work)
        scales.flush()
        return out

    def backward(self, dy: Tensor):
        p, s, El, x = self.problem, self.state, self.problem.num_local_experts, self.x
        dx, dprobs = torch.zeros_like(x), torch.zeros_like(self.probs)
        dy_fp8 = quantize_input(dy, "dy", s.recipe.grad_format, s.recipe, s.scales)
        saved_x = None if s.recipe.fp8_wgrad else x  # the bf16 weight gradients read x
        scales = OncePerPass(s.scales)

        def compute(hop, part, lead, trail):
            if x.shape[0] == 0:
                return  # the trail stays zero: no pairs of this rank's tokens
            w = self.wq if lead is None else _visiting(lead, self.wq, transposed=True)
            saved = Fp8Saved(self.x_fp8[0], self.x_fp8[1], None, saved_x, x.dtype)
            fp8_hop_backward(dy, saved, w, self.probs, self.index, part * El, (part + 1) * El,
                             recipe=s.recipe, scales=scales,
                             grads=hop_grads({"dx": dx, "dprobs": dprobs, **trail}),
                             options=self.options(part), dy_fp8=dy_fp8)  # fmt: skip

        dw = weights_layout(p, "d")
        work = PassWork(lead_layout=lambda q: self.layout, own_lead=self.own_lead(),
                        compute=compute, trail_layout=lambda q: dw)  # fmt: skip
        grads = ring_pass(p, self.call, x.device, "bwd", self.bwd, work)
        scales.flush()
        return dx, dprobs, home_grads(p, grads)


class _RingMoEFp8(torch.autograd.Function):
    """Inputs ``(x, probs, topk_idx, problem, call, state, listed, *ws)``, ``ws`` the experts'
    weights (tensor or list form, no biases). Saves x, probs and ``ws``; the fp8 x and the
    weights' fp8 copy are kept on the context."""

    @staticmethod
    def forward(ctx, x, probs, topk_idx, problem, call, state, listed, *ws):
        x, probs = x.contiguous(), probs.contiguous()
        if not listed:
            ws = tuple(w.contiguous() for w in ws)
        experts = LocalExperts.from_inputs(listed, ws, False, False, call.runtime)
        wq = _own_weights(state, experts, ws)
        ids = topk_idx.to(IDX).contiguous()
        index = build_routing_index(ids, problem.num_experts, validate=False)
        x_fp8 = quantize_input(x, "x", "e4m3", state.recipe, state.scales)
        run = _Fp8Call(problem, call, state, wq, index, x, probs, x_fp8)
        out = run.forward()
        ctx.run, ctx.listed = run, listed
        ctx.save_for_backward(*ws)
        return out

    @staticmethod
    def backward(ctx, dy):
        from relaymoe.ring.engine import SECOND_ORDER_ERROR

        if torch.is_grad_enabled():
            raise NotImplementedError(SECOND_ORDER_ERROR)
        ws = ctx.saved_tensors
        run = ctx.run
        experts = LocalExperts.from_inputs(ctx.listed, ws, False, False, run.call.runtime)
        dx, dprobs, g = run.backward(dy.to(run.problem.dtype).contiguous())
        wgrads = experts.split(g["w13"], g["w2"], FORWARD)
        need = ctx.needs_input_grad
        wgrads = tuple(g if need[7 + j] else None for j, g in enumerate(wgrads))
        return (dx if need[0] else None, dprobs if need[1] else None, *([None] * 5), *wgrads)


def fp8_ring_moe(x, topk_probs, topk_idx, problem: RingProblem, call, state: Fp8State,
                 listed: bool, ws) -> Tensor:  # fmt: skip
    """The fp8 expert ring on an agreed ``problem`` (``ring_moe`` validated and agreed; its
    ``config`` went through :func:`fp8_ring_config`)."""
    return _RingMoEFp8.apply(x, topk_probs, topk_idx, problem, call, state, listed, *ws)
