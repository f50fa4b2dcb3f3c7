"""Per-hop communication volume of the two ring modes (RelayMoE Table 2) and the auto choice.

Shape legend: T tokens of one partition, H hidden, I expert FFN width, El experts per rank,
K top-k. ``b`` bytes of an activation/weight element, ``pb`` of a router probability; expert ids
travel as int32 (4 bytes).

* expert forward: the weights, ``El*3*H*I*b``;
* expert backward: the weights plus the trailing weight gradients, ``2*El*3*H*I*b``;
* token forward: tokens and metadata ``T*(H*b + K*(4+pb))`` plus the trailing output ``T*H*b``;
* token backward: x, dy and metadata ``T*(2*H*b + K*(4+pb))`` plus the trailing dx and dprobs
  ``T*(H*b + K*pb)``.

Expert-mode volume is fixed by the model; token-mode volume grows with the tokens per rank, so
expert routing wins at long sequences / narrow experts and token routing at many or wide experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CommVolume", "comm_volume"]

_INDEX_BYTES = 4  # expert ids travel as int32


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CommVolume:
    """Bytes one rank sends per hop, per mode and pass (RelayMoE Table 2)."""

    expert_fwd: int
    expert_bwd: int
    token_fwd: int
    token_bwd: int

    @property
    def expert_step(self) -> int:
        """Forward + backward bytes per hop in expert mode."""
        return self.expert_fwd + self.expert_bwd

    @property
    def token_step(self) -> int:
        """Forward + backward bytes per hop in token mode."""
        return self.token_fwd + self.token_bwd

    def preferred(self, training: bool = True) -> str:
        """``"expert"`` or ``"token"``: the smaller per-hop volume (forward+backward when
        training, forward only otherwise). Ties go to expert mode (tokens stay home)."""
        if training:
            return "expert" if self.expert_step <= self.token_step else "token"
        return "expert" if self.expert_fwd <= self.token_fwd else "token"


def comm_volume(
    num_tokens: int,
    hidden: int,
    ffn: int,
    num_local_experts: int,
    topk: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    prob_dtype: torch.dtype = torch.float32,
) -> CommVolume:
    """Per-hop bytes of both modes for a token partition of ``num_tokens`` tokens.

    ``num_tokens`` is the largest partition (the hop that bounds the ring); ``dtype`` the
    activation/weight dtype, ``prob_dtype`` the router probabilities' dtype.
    """
    for name, v in (
        ("num_tokens", num_tokens),
        ("hidden", hidden),
        ("ffn", ffn),
        ("num_local_experts", num_local_experts),
        ("topk", topk),
    ):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    b, pb = _esize(dtype), _esize(prob_dtype)
    weights = num_local_experts * 3 * hidden * ffn * b
    meta = num_tokens * topk * (_INDEX_BYTES + pb)
    act = num_tokens * hidden * b
    return CommVolume(
        expert_fwd=weights,
        expert_bwd=2 * weights,
        token_fwd=act + meta + act,
        token_bwd=2 * act + meta + act + num_tokens * topk * pb,
    )
