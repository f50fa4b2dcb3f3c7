"""Per-hop ring communication volume, expert vs token routing (RelayMoE paper Table 2).

Per GPU and hop, with ``T = b*s/(SP*CP)`` local tokens, ``El = E/EP`` local experts and
``W = 3*H*I/ETP`` parameters of one expert (SwiGLU: gate, up, down):

* expert routing: forward ``El*W`` weights; backward the merged payload of the weights and the
  accumulated fp32 weight gradients ``El*W*(e + 4)``.
* token routing: forward the tokens, their routing metadata (``M`` bytes per token-expert pair:
  int32 expert id + fp32 probability) and the fp32 output accumulator coming home; backward the
  tokens, the output gradient, the fp32 dx accumulator and the fp32 dprobs accumulator (+ metadata).

The mode with the smaller forward+backward per-hop volume is chosen (paper §3.2).
"""

from __future__ import annotations

from relaymoe.planner.memory import Shapes

META_BYTES_PER_PAIR = 8


def per_hop_bytes(sh: Shapes) -> dict[str, dict[str, int]]:
    W = 3 * sh.h * sh.I  # one expert's parameters (I already divided by ETP)
    e = sh.e
    expert_fwd = sh.El * W * e
    expert_bwd = sh.El * W * (e + 4)
    meta = sh.P * META_BYTES_PER_PAIR
    token_fwd = sh.T * sh.h * e + meta + sh.T * sh.h * 4
    token_bwd = 2 * sh.T * sh.h * e + meta + sh.T * sh.h * 4 + sh.P * 4
    return {
        "expert": {"forward": expert_fwd, "backward": expert_bwd, "total": expert_fwd + expert_bwd},
        "token": {"forward": token_fwd, "backward": token_bwd, "total": token_fwd + token_bwd},
    }


def choose_mode(sh: Shapes, forced: str = "auto") -> str:
    if forced in ("expert", "token"):
        return forced
    if forced != "auto":
        raise ValueError(f"ring mode {forced!r}; known: 'auto', 'expert', 'token'")
    v = per_hop_bytes(sh)
    return "expert" if v["expert"]["total"] <= v["token"]["total"] else "token"
