"""The ring's routed experts under Megatron's fp8 recipe: whether they compute in fp8, with which
``relaymoe.Fp8Recipe``, what is refused, and the line a run prints (no Megatron import).

``--fp8-format`` with ``--moe-token-dispatcher-type ring`` and ``--relaymoe-fp8-experts on`` runs
the experts' GEMMs in fp8 with the model's recipe; ``off`` keeps them in bf16, TransformerEngine
still running attention and the dense layers in fp8. ``auto`` (the default) is ``on`` for a
recipe only where the experts were measured faster in fp8 than in bf16 (``FP8_EXPERT_MS``: a
user asking for fp8 must not get a slower MoE layer unasked), which today is no recipe, so
``auto`` keeps them in bf16 and the start-up notice says why, naming the measurement.
Megatron's flags map to :class:`relaymoe.Fp8Recipe`'s fields: ``--fp8-format`` to ``fmt``,
``--fp8-recipe`` to ``recipe``, ``--fp8-margin`` to ``margin``, ``--fp8-amax-history-len`` and
``--fp8-amax-compute-algo`` to delayed scaling's window, ``--no-fp8-wgrad`` to
``fp8_wgrad=False`` (with ``--fp8-wgrad``, Megatron's default, each recipe's own convention:
blockwise keeps bf16 weight gradients).

Refused at config time (every rank builds the same config, so every rank raises): recipes the
kernels do not implement (``mxfp8``, ``custom``), blockwise with H or the expert FFN size not
a multiple of 128, expert biases (``--add-bias-linear``), and what the fp8 ring does not run
(``--relaymoe-mode token``/``alltoall``, ``--relaymoe-schedule node_batched``, CUDA graphs over
the MoE layer). A GPU before Hopper is refused when the dispatcher is built (the device is
known there). Each message names the value, the limit and both fixes (change it, or
``--relaymoe-fp8-experts off``). Nothing is refused where the experts stay in bf16 (``off``, or
``auto`` where fp8 is not measured faster).

The layer's experts are quantised once per optimizer step (``Fp8State``'s cache, keyed on the
weights' storage and version counter). Megatron's optimizers write the updated weights through
``.data`` or a shared parameter buffer, which no version counter sees, so the patched
``train_step`` (``patches.patch_train_step``) calls :func:`invalidate_fp8_weights` on its model
before and after every step: the step's first forward quantises the weights it runs with, and an
evaluation after it too. A training loop of one's own calls it after each optimizer step.
"""

from __future__ import annotations

from relaymoe.fp8_recipe import BLOCK, FP8_RECIPES, Fp8Recipe

__all__ = [
    "FP8_EXPERT_MS",
    "FP8_EXPERT_MS_SOURCE",
    "auto_bf16_reason",
    "auto_runs_fp8",
    "fp8_expert_problems",
    "fp8_experts_option",
    "fp8_recipe_of",
    "fp8_requested",
    "invalidate_fp8_weights",
    "layer_fp8_state",
]

OFF_FIX = "or pass --relaymoe-fp8-experts off (experts in bf16, the other layers still in fp8)"

# What ``auto`` decides from: one expert layer's fwd+bwd in milliseconds, bf16 against each fp8
# recipe's kernels, per shape (``delayed`` runs the ``tensorwise`` kernels, its scales from a
# history). ``auto`` runs a recipe's experts in fp8 only where fp8 is below bf16 on every shape
# here: replace the numbers from a new run and the default follows. Regenerate with
#   python3 benchmarks/bench_experts.py --shapes qwen3_30b_a3b_T32k moeblaze_conf3 \
#       --providers relaymoe_act relaymoe_fp8_tensorwise relaymoe_fp8_blockwise
FP8_EXPERT_MS_SOURCE = "bench_experts fwd+bwd on 1x H100 80GB HBM3"
FP8_EXPERT_MS = {
    "qwen3_30b_a3b_T32k": {"bf16": 17.2, "tensorwise": 36.1, "blockwise": 22.0},
    "moeblaze_conf3": {"bf16": 36.5, "tensorwise": 95.9, "blockwise": 50.7},
}


def _kernels_of(recipe: str) -> str:
    """The recipe whose kernels ``recipe`` runs (delayed scaling: the tensorwise ones)."""
    return "tensorwise" if recipe == "delayed" else recipe


def auto_runs_fp8(recipe: str) -> bool:
    """Whether ``--relaymoe-fp8-experts auto`` runs ``recipe``'s experts in fp8: measured
    faster than bf16 on every shape of ``FP8_EXPERT_MS`` (False where never measured)."""
    kernels = _kernels_of(recipe)
    rows = [ms for ms in FP8_EXPERT_MS.values() if kernels in ms]
    return bool(rows) and all(ms[kernels] < ms["bf16"] for ms in rows)


def auto_bf16_reason(recipe: str) -> str:
    """Why ``auto`` keeps ``recipe``'s experts in bf16, with the measured rows."""
    if recipe not in FP8_RECIPES:
        return f"relaymoe's fp8 experts implement {FP8_RECIPES}, not {recipe!r}"
    kernels = _kernels_of(recipe)
    rows = [f"{ms[kernels]} ms against bf16's {ms['bf16']} ms at {shape}"
            for shape, ms in FP8_EXPERT_MS.items() if kernels in ms]  # fmt: skip
    if not rows:
        return f"relaymoe's {kernels} fp8 experts were never measured against bf16"
    ran = f"{kernels} kernels" if kernels == recipe else f"the tensorwise kernels, as {recipe}"
    return (f"relaymoe's fp8 experts ({ran}) are not measured faster than bf16 "
            f"({', '.join(rows)}: {FP8_EXPERT_MS_SOURCE})")  # fmt: skip


def _get(c, name, default=None):
    value = getattr(c, name, default)
    return getattr(value, "value", value)  # megatron-core's enums are str enums


def _ring_option(c, name: str):
    """The ring option ``name`` of Megatron arguments or a ``TransformerConfig``: the
    ``RingConfig`` attached to it (``args.relaymoe_ring``, ``configure``), else the flag's
    attribute (``relaymoe_<name>``), else the model's ``settings.ring_config_of`` (Megatron's
    parsed arguments, or the default)."""
    from relaymoe.options import RingConfig

    ring = getattr(c, "relaymoe_ring", None)
    if isinstance(ring, RingConfig):
        return getattr(ring, name)
    value = getattr(c, f"relaymoe_{name}", None)
    if value is not None:
        return value
    from relaymoe.megatron.settings import ring_config_of

    return getattr(ring_config_of(c), name)


def fp8_experts_option(c) -> str:
    """``--relaymoe-fp8-experts`` of Megatron arguments or a ``TransformerConfig``
    (:func:`_ring_option`'s order): ``auto`` unless set."""
    return _ring_option(c, "fp8_experts")


def fp8_requested(c, option: str | None = None) -> bool:
    """Whether a ring model of config or arguments ``c`` runs its experts in fp8: an fp8
    format, the ring dispatcher and ``--relaymoe-fp8-experts on``, or ``auto`` for a recipe
    :func:`auto_runs_fp8` (``option``: the value, when the caller holds the ``RingConfig``;
    default read from ``c``)."""
    if _get(c, "fp8") in (None, False) or _get(c, "moe_token_dispatcher_type") != "ring":
        return False  # decided without the option (whose lookup may import megatron.training)
    option = option or fp8_experts_option(c)
    if option == "auto":
        return auto_runs_fp8(_get(c, "fp8_recipe") or "delayed")  # Megatron's default recipe
    return option == "on"


def fp8_recipe_of(c, option: str | None = None) -> Fp8Recipe | None:
    """The experts' :class:`relaymoe.Fp8Recipe` for ``c`` (None: bf16 experts; ``option`` as
    :func:`fp8_requested`'s). Raises ``ValueError`` for a recipe it cannot map
    (``fp8_expert_problems`` says it first)."""
    if not fp8_requested(c, option):
        return None
    recipe = _get(c, "fp8_recipe") or "delayed"  # Megatron's default recipe
    algo = _get(c, "fp8_amax_compute_algo") or "most_recent"
    return Fp8Recipe(
        recipe=recipe,
        fmt=_get(c, "fp8"),
        amax_history_len=int(_get(c, "fp8_amax_history_len") or 1),
        amax_compute_algo=algo,
        margin=int(_get(c, "fp8_margin") or 0),
        fp8_wgrad=None if _get(c, "fp8_wgrad", True) else False,
    )


def fp8_expert_problems(c, *, graph_capture: bool = False) -> list[str]:
    """Why ``c``'s fp8 experts cannot run (empty: they can, or none are asked for).
    ``graph_capture``: the MoE layer is captured in CUDA graphs
    (``validate.ring_graph_capture``)."""
    if not fp8_requested(c):
        return []
    recipe = _get(c, "fp8_recipe") or "delayed"
    if recipe not in FP8_RECIPES:
        why = " (MX block scales need Blackwell's tensor cores)" if recipe == "mxfp8" else ""
        return [f"fp8_recipe={recipe!r}: the ring's fp8 experts implement {FP8_RECIPES}{why}; "
                f"fix: pass --fp8-recipe tensorwise, delayed or blockwise, {OFF_FIX}"]  # fmt: skip
    problems = []
    if recipe == "blockwise":
        ffn = _get(c, "moe_ffn_hidden_size") or _get(c, "ffn_hidden_size")
        for name, value in (("hidden_size", _get(c, "hidden_size")), ("moe_ffn_hidden_size", ffn)):
            if isinstance(value, int) and value % BLOCK:
                problems.append(
                    f"{name}={value} with --fp8-recipe blockwise: the experts quantise in "
                    f"{BLOCK}-wide blocks, so it must be a multiple of {BLOCK}; fix: use "
                    f"--fp8-recipe tensorwise, {OFF_FIX}"
                )
    if _get(c, "add_bias_linear", False):
        problems.append(f"add_bias_linear=True: the fp8 experts take no biases; fix: pass "
                        f"--disable-bias-linear, {OFF_FIX}")  # fmt: skip
    mode = _ring_option(c, "mode")
    if mode in ("token", "alltoall"):
        problems.append(f"relaymoe_mode={mode!r}: the fp8 experts run in expert mode; fix: pass "
                        f"--relaymoe-mode expert (or auto), {OFF_FIX}")  # fmt: skip
    schedule = _ring_option(c, "schedule")
    if schedule == "node_batched":
        problems.append(f"relaymoe_schedule='node_batched': the fp8 experts run the flat or "
                        f"two-level ring; fix: --relaymoe-schedule auto, {OFF_FIX}")  # fmt: skip
    if graph_capture:
        problems.append(f"CUDA graphs over the MoE layer (--cuda-graph-impl): the fp8 experts are "
                        f"not captured yet; fix: drop the CUDA-graph flags, {OFF_FIX}")  # fmt: skip
    return problems


def layer_fp8_state(config, option: str):
    """The ``relaymoe.Fp8State`` a ``RingDispatcher`` owns for its layer (None: bf16 experts):
    its recipe from ``config``, its delayed-scaling histories and its experts' fp8 copy. A GPU
    before Hopper is refused here (``ValueError`` naming it and the fix), on every rank."""
    recipe = fp8_recipe_of(config, option)
    if recipe is None:
        return None
    import torch

    from relaymoe.fp8_state import Fp8State, capability_problem

    if torch.cuda.is_available():
        dev = torch.cuda.current_device()
        problem = capability_problem(
            torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev)
        )
        if problem is not None:
            raise ValueError(f"{problem}; or pass --relaymoe-fp8-experts off")
    return Fp8State(recipe)


def invalidate_fp8_weights(model) -> int:
    """Drop the fp8 weight copies of every ring layer of ``model`` (a module or a list of
    model chunks): their next forward quantises the weights again. Returns how many layers."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    count = 0
    for chunk in chunks:
        for m in chunk.modules():
            state = getattr(getattr(m, "token_dispatcher", None), "fp8", None)
            if state is not None:
                state.invalidate()
                count += 1
    return count
