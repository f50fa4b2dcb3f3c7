"""The expert MLP's activation: which function, gated or not, and its GPT-OSS-style knobs.

Torch-free on purpose (level 0, beside ``options.py``): the oracle, the torch backend, the Triton
kernels, the ring and the Megatron integration all read one ``ExpertActivation``, and the
planner may reason about it without importing torch.

Shape legend: I expert FFN width; J the fc1 rows of one expert (``fc1_rows(I)``: 2I gated, I not).
With ``h (P, J)`` the pre-activation of P token-expert pairs (``x @ w13[e]^T + b13[e]``):

* gated (``gated=True``, Megatron's ``gated_linear_unit``): ``gate = h[:, :I]``,
  ``linear = h[:, I:]``; with ``limit`` both are clamped first (``gate`` to ``(-inf, limit]``,
  ``linear`` to ``[-limit, limit]``, Megatron's ``activation_func_clamp_value``), then
  ``a = fn(gate) * (linear + linear_offset)`` (``linear_offset``: Megatron's
  ``glu_linear_offset``);
* not gated: ``a = fn(h)``.

``fn`` is one of :data:`FNS`: ``silu`` (``x * sigmoid(alpha * x)``; ``alpha=1.702`` is Megatron's
``quick_gelu``, used by GPT-OSS), ``gelu`` (the exact erf form: ``torch.nn.functional.gelu``'s
default, Megatron's ``F.gelu``), ``gelu_tanh`` (the tanh approximation: Megatron's
``fast_gelu``/``openai_gelu``, ``F.gelu(approximate="tanh")``), ``relu`` and ``squared_relu``
(``relu(x) ** 2``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FNS", "NAMES", "SWIGLU", "ExpertActivation", "as_activation", "fc1_rows"]

FNS = ("silu", "gelu", "gelu_tanh", "relu", "squared_relu")
_GATED_NAMES = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh", "relu": "reglu",
                "squared_relu": "squared_reglu"}  # fmt: skip


def fc1_rows(ffn: int, *, gated: bool) -> int:
    """Rows of one expert's fc1 weight for FFN width ``ffn``: gate and linear halves (2*ffn)
    when ``gated``, else ``ffn``. What ``ExpertActivation.fc1_rows`` and the planner size fc1
    by (the cost model, which imports only itself and ``options``, states it again in
    ``Dims.J``)."""
    return 2 * ffn if gated else ffn


def _real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fail(field: str, value, limit: str, fix: str) -> None:
    raise ValueError(f"ExpertActivation: {field}={value!r} {limit}; {fix}")


@dataclass(frozen=True)
class ExpertActivation:
    """One expert MLP activation (see the module docstring for the formulas).

    ``fn``: one of ``FNS``. ``gated``: fc1 has ``2I`` rows ``[gate; linear]`` (True) or ``I``
    (False). ``alpha``: silu's ``x * sigmoid(alpha * x)`` slope (1.0 elsewhere). ``limit``: the
    gated clamp value (None: no clamp). ``linear_offset``: added to the gated linear half.
    Validated on construction (``ValueError`` naming the field, the value, the limit, the fix).
    """

    fn: str = "silu"
    gated: bool = True
    alpha: float = 1.0
    limit: float | None = None
    linear_offset: float = 0.0

    def __post_init__(self):
        if self.fn not in FNS:
            _fail("fn", self.fn, f"is not one of {FNS}", "pick one of those (e.g. fn='gelu')")
        if not isinstance(self.gated, bool):
            _fail("gated", self.gated, "must be a bool", "pass gated=True or gated=False")
        if not _real(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
            _fail("alpha", self.alpha, "must be a finite number > 0",
                  "pass e.g. alpha=1.702 (quick_gelu) or leave the default 1.0")  # fmt: skip
        if self.alpha != 1.0 and self.fn != "silu":
            _fail("alpha", self.alpha, f"applies to fn='silu' only (fn is {self.fn!r})",
                  "drop alpha, or use fn='silu' for x * sigmoid(alpha * x)")  # fmt: skip
        if self.limit is not None:
            if not _real(self.limit) or not math.isfinite(self.limit) or self.limit <= 0:
                _fail("limit", self.limit, "must be None or a finite number > 0",
                      "pass e.g. limit=7.0 (GPT-OSS) or None for no clamp")  # fmt: skip
            if not self.gated:
                _fail("limit", self.limit, "applies to gated activations only (gated=False)",
                      "drop limit, or set gated=True")  # fmt: skip
        if not _real(self.linear_offset) or not math.isfinite(self.linear_offset):
            _fail("linear_offset", self.linear_offset, "must be a finite number",
                  "pass e.g. linear_offset=1.0 (GPT-OSS) or leave the default 0.0")  # fmt: skip
        if self.linear_offset != 0.0 and not self.gated:
            _fail("linear_offset", self.linear_offset,
                  "applies to gated activations only (gated=False)",
                  "drop linear_offset, or set gated=True")  # fmt: skip
        # numbers stored as floats: equal activations compare and hash equal (1 == 1.0 anyway)
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "linear_offset", float(self.linear_offset))
        if self.limit is not None:
            object.__setattr__(self, "limit", float(self.limit))

    def fc1_rows(self, ffn: int) -> int:
        """Rows of one expert's fc1 weight (``w13[e]``) for FFN width ``ffn``: 2*ffn gated."""
        return fc1_rows(ffn, gated=self.gated)

    @property
    def name(self) -> str:
        """A short readable name: ``swiglu``, ``geglu``, ``gelu``, ``squared_relu``, ...; knobs
        off their defaults in parentheses, a clamp as a ``clamped_`` prefix, e.g.
        ``clamped_swiglu(alpha=1.702,limit=7.0,offset=1.0)``."""
        base = _GATED_NAMES[self.fn] if self.gated else self.fn
        if self.limit is not None:
            base = "clamped_" + base
        knobs = []
        if self.alpha != 1.0:
            knobs.append(f"alpha={self.alpha!r}")
        if self.limit is not None:
            knobs.append(f"limit={self.limit!r}")
        if self.linear_offset != 0.0:
            knobs.append(f"offset={self.linear_offset!r}")
        return f"{base}({','.join(knobs)})" if knobs else base

    def __str__(self) -> str:
        return self.name


SWIGLU = ExpertActivation()

# the names as_activation accepts, each an activation without knobs
NAMES = {
    **{gated: ExpertActivation(fn=fn) for fn, gated in _GATED_NAMES.items()},
    **{fn: ExpertActivation(fn=fn, gated=False) for fn in FNS},
}
_NEED_KNOBS = {
    "quick_geglu": "ExpertActivation(fn='silu', alpha=1.702)",
    "clamped_swiglu": "ExpertActivation(fn='silu', alpha=1.702, limit=7.0, linear_offset=1.0)",
}


def as_activation(value) -> ExpertActivation:
    """``value`` as an ``ExpertActivation``: None -> ``SWIGLU`` (today's default), an
    ``ExpertActivation`` -> itself, a name of :data:`NAMES` -> that activation (``silu`` is the
    non-gated one; ``swiglu`` the gated). Anything else raises ``ValueError`` naming the value,
    the accepted names and the fix."""
    if value is None:
        return SWIGLU
    if isinstance(value, ExpertActivation):
        return value
    if isinstance(value, str) and value in NAMES:
        return NAMES[value]
    if isinstance(value, str) and value in _NEED_KNOBS:
        raise ValueError(
            f"activation {value!r} has knobs a name cannot carry; pass {_NEED_KNOBS[value]} "
            "(GPT-OSS's values; adjust them to your model's)"
        )
    raise ValueError(
        f"activation must be None, an ExpertActivation or one of {sorted(NAMES)}, got "
        f"{value!r}; pass one of those names, or ExpertActivation(fn=..., gated=..., alpha=..., "
        "limit=..., linear_offset=...) for other knobs"
    )
