"""fp8 recipes of the expert GEMMs, by TransformerEngine's names; torch-free.

A recipe says how the expert MLP's GEMMs are quantised, never what they compute:

* ``tensorwise`` (TE's ``Float8CurrentScaling``): one scale per tensor, computed from the
  tensor's own amax at the moment it is quantised;
* ``delayed`` (TE's ``DelayedScaling``): one scale per tensor, from the amax history of the
  tensors quantised before it (``amax_history_len`` calls, ``amax_compute_algo``); the history
  lives in the caller's ``relaymoe.fp8_state.Fp8State``, never in process state;
* ``blockwise`` (TE's ``Float8BlockScaling``, DeepSeek-V3's scheme): activations and gradients
  in 1x128 tiles along the contraction, weights in 128x128 blocks, each with its own scale
  (powers of two by default, as TE), and each 128-wide K block's partial product promoted into
  the fp32 accumulator with its two scales.

Formats (TE's ``Format``): ``e4m3`` everywhere, or ``hybrid`` (e4m3 forward, e5m2 for the
gradients of the backward). TE's defaults: ``hybrid`` for the tensor-scaled recipes, ``e4m3``
for blockwise.

Which GEMM runs in fp8 (``gemms_in_fp8``), per the TE convention each recipe follows:
fprop (h = x w13^T, y = a w2^T) and dgrad (g = dy w2, dx = dh w13) in fp8 for every recipe;
wgrad (dw2 = dy^T (p a), dw13 = dh^T x) in fp8 for the tensor-scaled recipes. For ``blockwise``
the weight gradients run in bf16: their fp8 form contracts over the pairs of each expert, so it
needs x quantised in 128-pair blocks along each expert's gathered rows, a pass over the
top-k-expanded (T*K, H) that the gather-on-load kernels exist to avoid (TE quantises its
permuted copy of x twice, rowwise and columnwise, for this). Weights are quantised from their
own amax (per expert, or per 128x128 block) once per optimizer step, for every recipe.

Accumulation: Hopper's fp8 tensor cores accumulate with reduced precision; the fprop GEMMs of
the tensor-scaled recipes accumulate there (TE's fast fprop), dgrad and wgrad promote into fp32
every 128 K elements (TE's split accumulator), blockwise promotes every 128 in every GEMM (its
scales change per K block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "AMAX_ALGOS",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "BLOCK",
    "Fp8Recipe",
    "as_fp8_recipe",
]

FP8_RECIPES = ("tensorwise", "delayed", "blockwise")
FP8_FORMATS = ("hybrid", "e4m3")
AMAX_ALGOS = ("max", "most_recent")
BLOCK = 128  # blockwise: the 1x128 activation tiles and the 128x128 weight blocks
# TE's default format of each recipe
_DEFAULT_FORMAT = {"tensorwise": "hybrid", "delayed": "hybrid", "blockwise": "e4m3"}


@dataclass(frozen=True)
class Fp8Recipe:
    """One fp8 recipe of the expert GEMMs (frozen, hashable; validated when built).

    ``recipe``: ``tensorwise``, ``delayed`` or ``blockwise`` (module docstring). ``fmt``:
    ``hybrid`` (e4m3 forward, e5m2 gradients) or ``e4m3``; None: TE's default for the recipe.
    ``amax_history_len``, ``amax_compute_algo`` (``max`` or ``most_recent``): delayed scaling's
    window (TE's defaults 1024 and ``max``). ``margin``: scales divided by ``2**margin`` (the
    tensor-scaled recipes). ``power_2_scales``: blockwise scales rounded down to powers of two
    (None: TE's default, True for blockwise; the tensor-scaled recipes' scales are never
    rounded). ``fp8_wgrad``: the weight gradients in fp8 (Megatron's ``--fp8-wgrad``, TE's
    ``override_linear_precision``); None: the recipe's convention (``gemms_in_fp8``), False runs
    them in bf16, True is refused for blockwise."""

    recipe: str = "tensorwise"
    fmt: str | None = None
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    power_2_scales: bool | None = field(default=None)
    fp8_wgrad: bool | None = None

    def __post_init__(self):
        if self.recipe not in FP8_RECIPES:
            hint = " (mxfp8 needs Blackwell's block-scaled tensor cores)" if (
                self.recipe == "mxfp8") else ""  # fmt: skip
            raise ValueError(f"fp8 recipe {self.recipe!r} is not one of {FP8_RECIPES}{hint}")
        if self.fmt is None:
            object.__setattr__(self, "fmt", _DEFAULT_FORMAT[self.recipe])
        if self.fmt not in FP8_FORMATS:
            raise ValueError(f"fp8 format {self.fmt!r} is not one of {FP8_FORMATS}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(
                f"amax_compute_algo {self.amax_compute_algo!r} is not one of {AMAX_ALGOS}"
            )
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        if self.power_2_scales is None:
            object.__setattr__(self, "power_2_scales", self.recipe == "blockwise")
        if self.power_2_scales and self.recipe != "blockwise":
            raise ValueError("power_2_scales applies to the blockwise recipe only")
        if self.fp8_wgrad is None:
            object.__setattr__(self, "fp8_wgrad", self.recipe != "blockwise")
        if self.fp8_wgrad and self.recipe == "blockwise":
            raise ValueError(
                "fp8_wgrad=True with the blockwise recipe: its fp8 weight gradients need x "
                "quantised in 128-pair blocks of each expert's gathered rows, a pass over the "
                "top-k-expanded (T*K, H); use fp8_wgrad=None (bf16 weight gradients)"
            )

    @property
    def blockwise(self) -> bool:
        return self.recipe == "blockwise"

    @property
    def grad_format(self) -> str:
        """The format of the backward's gradients (dy, dh): e5m2 under ``hybrid``."""
        return "e5m2" if self.fmt == "hybrid" else "e4m3"

    def gemms_in_fp8(self) -> dict[str, bool]:
        """``{"fprop": ..., "dgrad": ..., "wgrad": ...}``: which GEMMs run in fp8."""
        return {"fprop": True, "dgrad": True, "wgrad": bool(self.fp8_wgrad)}


def as_fp8_recipe(value) -> Fp8Recipe | None:
    """None (no fp8), a recipe name (``"tensorwise"``, ``"delayed"``, ``"blockwise"``) or an
    :class:`Fp8Recipe`; anything else raises ``ValueError`` naming what is accepted."""
    if value is None or isinstance(value, Fp8Recipe):
        return value
    if isinstance(value, str):
        return Fp8Recipe(recipe=value)
    raise ValueError(
        f"fp8={value!r} must be None, a recipe name {FP8_RECIPES} or a relaymoe.Fp8Recipe "
        "(or a relaymoe.Fp8State holding one)"
    )
