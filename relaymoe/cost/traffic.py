"""Bytes on the links: what one rank sends per hop and per layer step in each mode."""

from __future__ import annotations

import math
from dataclasses import dataclass

from relaymoe.cost.dims import Dims, check_mode
from relaymoe.cost.links import INDEX_BYTES
from relaymoe.options import RING_MODES


@dataclass(frozen=True)
class HopBytes:
    """Bytes one rank sends at one hop of a ring mode, payload only (no alignment padding)."""

    fwd_lead: int
    fwd_trail: int
    bwd_lead: int
    bwd_trail: int

    @property
    def fwd(self) -> int:
        return self.fwd_lead + self.fwd_trail

    @property
    def bwd(self) -> int:
        return self.bwd_lead + self.bwd_trail

    @property
    def step(self) -> int:
        return self.fwd + self.bwd


def hop_bytes(mode: str, d: Dims) -> HopBytes:
    """Per-hop bytes of a ring mode (RelayMoE Table 2). Expert mode: the local experts' ``W``
    elements (weights and the biases they carry) lead, and their gradients trail in ``d.gb``
    bytes an element."""
    check_mode(mode, RING_MODES)
    if mode == "expert":
        w = d.W
        return HopBytes(fwd_lead=w * d.b, fwd_trail=0, bwd_lead=w * d.b, bwd_trail=w * d.gb)
    x, ids, probs = d.T * d.H * d.b, d.T * d.K * INDEX_BYTES, d.T * d.K * d.pb
    return HopBytes(
        fwd_lead=x + ids + probs, fwd_trail=x, bwd_lead=2 * x + probs, bwd_trail=x + probs
    )


def alltoall_rows(d: Dims) -> float:
    """Expected rows one rank sends in alltoall mode, its own included: ``S = T*R*q`` with
    ``q = 1 - C(E-El, K)/C(E, K)`` (a token's K distinct experts drawn uniformly; ``q`` is the
    chance that at least one lies on a given rank)."""
    q = 1.0 - math.comb(d.E - d.El, d.K) / math.comb(d.E, d.K)
    return d.T * d.R * q


@dataclass(frozen=True)
class StepBytes:
    """Bytes one rank sends over its links in one layer step (forward, backward)."""

    fwd: float
    bwd: float

    @property
    def step(self) -> float:
        return self.fwd + self.bwd


def step_bytes(mode: str, d: Dims, *, training: bool = True) -> StepBytes:
    """Link bytes of one layer step on one rank. Ring: the lead ``R-1`` times and the trail
    ``R`` times per pass (the schedule in the module docstring). Alltoall: the ``(R-1)/R`` of
    the ``S`` rows that leave the rank, out and back."""
    check_mode(mode)
    R = d.R
    if R == 1:
        return StepBytes(0.0, 0.0)
    if mode == "alltoall":
        away = alltoall_rows(d) * (R - 1) / R
        Hb = d.H * d.b
        fwd = away * ((Hb + d.m) + Hb)  # x and metadata out, the output back
        bwd = away * (2 * Hb + (Hb + d.K * d.pb))  # x and dy out, dx and dprobs back
    else:
        h = hop_bytes(mode, d)
        fwd = (R - 1) * h.fwd_lead + R * h.fwd_trail
        bwd = (R - 1) * h.bwd_lead + R * h.bwd_trail
    return StepBytes(float(fwd), float(bwd) if training else 0.0)
