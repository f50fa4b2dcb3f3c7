"""The expert MLP in the agreement's row: the activation and the biases every rank must share.

Every rank computes every expert (expert mode: the visiting experts; token mode: the visiting
tokens on its own experts), so a rank whose activation or bias presence differs from its peers'
would compute another layer, and in expert mode send a weight partition of another layout. The
agreement (``agree.py``) writes each rank's activation (every field of it) and its bias
presence into the rank's row as integers and refuses a difference with a ``ValueError`` naming
each rank's value, raised the same on every rank before any P2P.
"""

from __future__ import annotations

import struct

from relaymoe.activation import FNS, ExpertActivation

__all__ = ["activation_fields", "activation_of", "bias_code", "same_expert_mlp"]

_BIAS_NAMES = {1: "none", 2: "b13", 3: "b2", 4: "b13 and b2"}


def _float_bits(v: float) -> int:
    """The IEEE-754 bits of ``v`` as an int64: an agreement row holds integers, and its sum
    (one nonzero row per rank) moves them exactly."""
    return struct.unpack("<q", struct.pack("<d", v))[0]


def _bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", n))[0]


def activation_fields(act: ExpertActivation) -> list[int]:
    """Every field of ``act`` as five row integers: fn (1-based in ``FNS``), gated (1 no, 2
    yes), the bits of alpha, of limit (0: None; a limit is > 0, so its bits are not 0) and of
    linear_offset."""
    limit = 0 if act.limit is None else _float_bits(act.limit)
    return [FNS.index(act.fn) + 1, int(act.gated) + 1, _float_bits(act.alpha), limit,
            _float_bits(act.linear_offset)]  # fmt: skip


def activation_of(fields) -> ExpertActivation:
    """The ``ExpertActivation`` of :func:`activation_fields`' five integers."""
    fn, gated, alpha, limit, offset = fields
    return ExpertActivation(fn=FNS[fn - 1], gated=gated == 2, alpha=_bits_float(alpha),
                            limit=None if limit == 0 else _bits_float(limit),
                            linear_offset=_bits_float(offset))  # fmt: skip


def bias_code(has_b13: bool, has_b2: bool) -> int:
    """The row integer of a rank's bias presence: 1 none, 2 b13, 3 b2, 4 both."""
    return 1 + int(has_b13) + 2 * int(has_b2)


def same_expert_mlp(act_fields, bias_codes) -> tuple[ExpertActivation, bool, bool]:
    """``(activation, has_b13, has_b2)`` of the group from every rank's
    :func:`activation_fields` and :func:`bias_code`; ``ValueError`` naming each rank's value
    when they differ."""
    acts = [activation_of(f) for f in act_fields]
    if len(set(acts)) != 1:
        shown = ", ".join(f"rank {r}: {a} = {a!r}" for r, a in enumerate(acts))
        raise ValueError(
            f"ring_moe: the expert activation differs across ranks ({shown}); every rank of "
            "the group computes every expert, so pass the same activation= on every rank"
        )
    if len(set(bias_codes)) != 1:
        shown = ", ".join(f"rank {r}: {_BIAS_NAMES[c]}" for r, c in enumerate(bias_codes))
        raise ValueError(
            f"ring_moe: the expert biases differ across ranks ({shown}); every rank's experts "
            "must carry the same biases (Megatron's add_bias_linear): pass the same of b13/b2 "
            "on every rank"
        )
    code = bias_codes[0]
    return acts[0], code in (2, 4), code in (3, 4)
