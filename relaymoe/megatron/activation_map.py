"""Megatron's expert MLP options read as one ``ExpertActivation``: what its experts compute.

The ring must compute exactly what megatron-core 0.19's own experts compute for the same
configuration, so a model trained with one dispatcher continues with the other. This module
reads the options (never guesses them) and refuses, by name, the combinations it cannot map.

Megatron's activation functions (recognised by identity or by module and name, so a
``torch.compile``-wrapped one is still known):

======================================================  ==========================================
``activation_func``                                     ``ExpertActivation``
======================================================  ==========================================
``F.silu``                                              ``fn="silu"``
``megatron.core``'s ``quick_gelu`` (``x*sigmoid(1.702x)``, ``fn="silu", alpha=1.702``
both the ``activations`` and the ``fused_bias_geglu`` one)
``F.gelu``; ``transformer.utils.erf_gelu``              ``fn="gelu"`` (``erf_gelu`` writes
                                                        sqrt(2) as 1.41421: 2e-6 off at most)
``activations.fast_gelu``; ``transformer.utils``'s      ``fn="gelu_tanh"``
``openai_gelu``/``gelu_impl``
``F.relu``                                              ``fn="relu"``
``activations.squared_relu``                            ``fn="squared_relu"``
======================================================  ==========================================

``gated_linear_unit`` is ``gated``; a gated unit's ``activation_func_clamp_value`` is ``limit``
and its ``glu_linear_offset`` is ``linear_offset`` (Megatron's unfused ``glu()``: clamp the gate
above, the linear half on both sides, then ``fn(gate) * (linear + offset)``). Biases
(``add_bias_linear``) are the experts' own parameters, read by ``expert_weights.py``.

Options that choose Megatron's implementation, and how each is mapped:

* ``bias_activation_fusion``: the fused SwiGLU and quick-GeGLU kernels compute the unfused
  function, with two exceptions, refused: the fused SwiGLU ignores the clamp; and in
  ``SequentialMLP`` experts (the local spec, or TransformerEngine without
  ``--moe-grouped-gemm``) the fused quick-GeGLU clamps fc1's output *before* adding its bias
  (``weighted_bias_quick_geglu_impl`` gets the bias separately), where ``TEGroupedMLP``, the
  unfused path and the ring clamp after. Megatron's experts have no fused kernel for other
  activations (nor SequentialMLP's for a SwiGLU with biases) and raise at their first
  forward; the ring computes the named function.
* ``use_te_activation_func`` (TransformerEngine spec only; the local spec has no TE module):
  TE's GELU and GEGLU are the tanh approximation, so ``F.gelu`` maps to ``gelu_tanh``. TE's
  operations take no clamp and no offset (refused when set), and megatron-core's
  ``TEActivationOp`` builds TE's ReLU for a non-gated ``F.silu`` (refused: say which you mean).
* ``use_fused_weighted_squared_relu``, ``activation_func_fp8_input_store``: the same function
  (the latter keeps the activation's input in fp8 for Megatron's backward; the ring recomputes).

Also refused: a clamp or offset on a non-gated unit (Megatron never reads them there), and
``--swiglu`` together with ``--squared-relu`` or ``--quick-geglu`` (Megatron asserts on it).
Megatron's ``--openai-gelu`` and ``--onnx-safe`` set no activation in megatron-core 0.19's
argument translation: Megatron computes ``F.gelu`` with them, and so does the ring.

Torch-free at import (names and attributes only); the command-line view mirrors
``megatron.training.argument_utils.core_transformer_config_from_args``.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaymoe.activation import ExpertActivation

__all__ = ["MEGATRON_FUNCTIONS", "expert_activation_of", "expert_activation_problems",
           "megatron_function_name"]  # fmt: skip

QUICK_GELU_ALPHA = 1.702
TE_IMPL = "transformer_engine"  # Megatron's default --transformer-impl

# (module, name) of the activation functions megatron-core builds -> the name used below
_BY_MODULE = {
    ("torch.nn.functional", "silu"): "silu",
    ("torch.nn.functional", "gelu"): "gelu",
    ("torch._C._nn", "gelu"): "gelu",
    ("torch.nn.functional", "relu"): "relu",
    ("megatron.core.activations", "squared_relu"): "squared_relu",
    ("megatron.core.activations", "quick_gelu"): "quick_gelu",
    ("megatron.core.fusions.fused_bias_geglu", "quick_gelu"): "quick_gelu",
    ("megatron.core.activations", "fast_gelu"): "fast_gelu",
    ("megatron.core.transformer.utils", "openai_gelu"): "openai_gelu",
    ("megatron.core.transformer.utils", "gelu_impl"): "openai_gelu",
    ("megatron.core.transformer.utils", "erf_gelu"): "erf_gelu",
}
# each name -> the ExpertActivation keywords of its function
MEGATRON_FUNCTIONS = {
    "silu": {"fn": "silu"},
    "quick_gelu": {"fn": "silu", "alpha": QUICK_GELU_ALPHA},
    "gelu": {"fn": "gelu"},
    "erf_gelu": {"fn": "gelu"},
    "fast_gelu": {"fn": "gelu_tanh"},
    "openai_gelu": {"fn": "gelu_tanh"},
    "relu": {"fn": "relu"},
    "squared_relu": {"fn": "squared_relu"},
}
_KNOWN = "silu/gelu/gelu_tanh/relu/squared_relu/quick_gelu"
_FIX_FN = (
    "fix: use torch.nn.functional's silu, gelu or relu or megatron.core's squared_relu, "
    "quick_gelu, fast_gelu, openai_gelu or erf_gelu (flags: --swiglu, --squared-relu, "
    "--quick-geglu, or none of them for gelu)"
)


def megatron_function_name(fn) -> str | None:
    """The key of ``MEGATRON_FUNCTIONS`` for an ``activation_func`` (None: not one of them),
    by module and name (``torch.nn.functional.silu`` is ``F.silu`` itself), unwrapping
    ``functools.wraps`` wrappers such as ``torch.compile``'s."""
    for _ in range(8):
        if fn is None:
            return None
        key = (getattr(fn, "__module__", None), getattr(fn, "__name__", None))
        if key in _BY_MODULE:
            return _BY_MODULE[key]
        fn = getattr(fn, "__wrapped__", None)
    return None


def _shown(fn) -> str:
    if fn is None:
        return "None"
    module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    return f"{module}.{name}" if module and name else repr(fn)


@dataclass(frozen=True)
class _View:
    """The options that decide the experts' function, named for config fields or flags."""

    fn: str | None  # MEGATRON_FUNCTIONS key (None: unknown)
    fn_shown: str  # how to name it in a message
    gated: bool
    clamp: object
    offset: object
    fusion: bool
    te_act: bool  # TransformerEngine's activation modules build the experts' activation
    grouped: bool  # TEGroupedMLP experts (else SequentialMLP)
    bias: bool
    args_style: bool

    def flag(self, field: str) -> str:
        return "--" + field.replace("_", "-")


def _config_view(c) -> _View:
    g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    te = (g("transformer_impl") or TE_IMPL) == TE_IMPL
    fn = g("activation_func")
    return _View(
        fn=megatron_function_name(fn), fn_shown=_shown(fn), gated=bool(g("gated_linear_unit")),
        clamp=g("activation_func_clamp_value"), offset=g("glu_linear_offset", 0.0) or 0.0,
        fusion=bool(g("bias_activation_fusion")), te_act=te and bool(g("use_te_activation_func")),
        grouped=te and bool(g("moe_grouped_gemm")), bias=bool(g("add_bias_linear", True)),
        args_style=False,
    )  # fmt: skip


def _args_view(a) -> tuple[_View, list[str]]:
    """Megatron's translation of the flags (argument_utils), with its parser's defaults."""
    g = lambda name, default=None: getattr(a, name, default)  # noqa: E731
    problems = []
    swiglu, squared, quick = bool(g("swiglu")), bool(g("squared_relu")), bool(g("quick_geglu"))
    for other, on in (("--squared-relu", squared), ("--quick-geglu", quick)):
        if swiglu and on:
            problems.append(
                f"--swiglu with {other}: Megatron's argument translation asserts on the pair; "
                f"fix: keep one of them"
            )
    bias = bool(g("add_bias_linear", True))  # --disable-bias-linear
    if swiglu:
        fn, gated, fusion = "silu", True, bool(g("bias_swiglu_fusion", True))
    else:  # Megatron's validate_args turns the gelu fusion off without biases
        fn, gated, fusion = "gelu", False, bool(g("bias_gelu_fusion", True)) and bias
    if squared:
        fn = "squared_relu"
    elif quick:
        fn, gated = "quick_gelu", True
    te = (g("transformer_impl") or TE_IMPL) == TE_IMPL
    shown = {"silu": "--swiglu", "squared_relu": "--squared-relu", "quick_gelu": "--quick-geglu"}
    view = _View(
        fn=fn, fn_shown=shown.get(fn, "gelu (no activation flag)"), gated=gated,
        clamp=g("activation_func_clamp_value"), offset=g("glu_linear_offset", 0.0) or 0.0,
        fusion=fusion, te_act=te and bool(g("use_te_activation_func")),
        grouped=te and bool(g("moe_grouped_gemm")), bias=bias, args_style=True,
    )  # fmt: skip
    return view, problems


def _fusion_flag(v: _View) -> str:
    flag = "--no-bias-swiglu-fusion" if v.fn == "silu" else "--no-bias-gelu-fusion"
    return flag if v.args_style else f"bias_activation_fusion=False ({flag})"


def _resolve(v: _View) -> tuple[ExpertActivation | None, list[str]]:
    problems: list[str] = []
    if v.fn is None:
        problems.append(
            f"the ring computes {_KNOWN} experts; activation_func={v.fn_shown} is not one; "
            f"{_FIX_FN}"
        )
        return None, problems
    kw = dict(MEGATRON_FUNCTIONS[v.fn])
    clamp_set, offset_set = v.clamp is not None, v.offset != 0.0
    clamp_txt = f"activation_func_clamp_value={v.clamp}"
    offset_txt = f"glu_linear_offset={v.offset}"
    if not v.gated:
        for on, txt, field in ((clamp_set, clamp_txt, "activation_func_clamp_value"),
                               (offset_set, offset_txt, "glu_linear_offset")):  # fmt: skip
            if on:
                problems.append(
                    f"{txt} on a non-gated {v.fn} unit: Megatron applies it to gated units "
                    f"only and ignores it here; fix: remove {v.flag(field)}"
                )
        clamp_set = offset_set = False
    if v.te_act:
        if v.fn == "gelu":
            kw = {"fn": "gelu_tanh"}  # TE's GELU/GEGLU: the tanh approximation
        if v.fn == "silu" and not v.gated:
            problems.append(
                "use_te_activation_func=True with a non-gated silu: megatron-core's "
                "TEActivationOp builds TransformerEngine's ReLU for it, so Megatron's experts "
                "compute relu; fix: remove --use-te-activation-func (both then compute silu), "
                "or ask for relu"
            )
        for on, txt, field in ((clamp_set, clamp_txt, "activation_func_clamp_value"),
                               (offset_set, offset_txt, "glu_linear_offset")):  # fmt: skip
            if on:
                problems.append(
                    f"{txt} with use_te_activation_func=True: TransformerEngine's activation "
                    f"takes no clamp or offset, so Megatron's experts ignore it; fix: remove "
                    f"--use-te-activation-func or {v.flag(field)}"
                )
    elif v.fusion and v.gated and clamp_set:
        if v.fn == "silu":
            problems.append(
                f"{clamp_txt} with bias_activation_fusion=True: Megatron's fused SwiGLU "
                f"ignores the clamp; fix: {_fusion_flag(v)} (the clamp then applies), or "
                f"remove --activation-func-clamp-value"
            )
        elif v.fn == "quick_gelu" and v.bias and not v.grouped:
            problems.append(
                f"{clamp_txt} with expert biases and bias_activation_fusion=True in "
                f"SequentialMLP experts: Megatron's fused quick-GeGLU clamps fc1's output before "
                f"adding its bias there, TEGroupedMLP and the unfused path (and the ring) after; "
                f"fix: {_fusion_flag(v)}, or --transformer-impl transformer_engine with "
                f"--moe-grouped-gemm"
            )
    if problems:
        return None, problems
    if v.gated:
        kw.update(limit=v.clamp, linear_offset=v.offset)
    try:
        return ExpertActivation(gated=v.gated, **kw), []
    except ValueError as exc:  # a clamp or offset out of range
        return None, [
            f"{clamp_txt}, {offset_txt}: not a clamp/offset the ring computes ({exc}); fix: "
            f"pass --activation-func-clamp-value a finite value > 0 (or none) and "
            f"--glu-linear-offset a finite value"
        ]


def expert_activation_problems(c, *, args_style: bool = False):
    """``(ExpertActivation or None, problems)`` for a ``TransformerConfig`` (or an object with
    its fields) or, with ``args_style``, Megatron's parsed arguments. Each problem names the
    option, its value and the fix; the activation is None when there is any."""
    if args_style:
        view, problems = _args_view(c)
        act, more = _resolve(view)
        problems += more
        return (None if problems else act), problems
    return _resolve(_config_view(c))


def expert_activation_of(config) -> ExpertActivation:
    """The ``ExpertActivation`` Megatron's experts compute for ``config``; ``ValueError``
    listing every problem when it cannot be mapped."""
    act, problems = expert_activation_problems(config)
    if problems:
        raise ValueError("the ring cannot map this expert MLP:\n  - " + "\n  - ".join(problems))
    return act
