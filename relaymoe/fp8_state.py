"""The fp8 state of one layer's experts, and the call-time checks of an fp8 expert call.

:class:`Fp8State` is an object its owner hands down (a layer keeps one; nothing is process
state): the recipe, the tensor-scale source (delayed scaling's amax histories), and the fp8 copy
of the layer's weights, quantised once per optimizer step: the copy is keyed on the weights'
identity, storage and version counter (``w._version``, bumped by every in-place update such as
an optimizer step), so the micro-batches of one step share it and the step after re-quantises.
An update that bypasses the version counter (a write through ``w.data``) is not seen: call
:meth:`Fp8State.invalidate` after it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from relaymoe.fp8_recipe import BLOCK, Fp8Recipe, as_fp8_recipe
from relaymoe.kernels.fp8.scaling import scaling_for
from relaymoe.kernels.fp8.weights import Fp8ExpertWeights, quantize_expert_weights

__all__ = [
    "FP8_DTYPES_IN",
    "Fp8State",
    "capability_problem",
    "check_fp8_call",
    "resolve_fp8",
    "weights_key",
]

# what the fp8 kernels quantise from (and compute h, a, the outputs and gradients in)
FP8_DTYPES_IN = (torch.bfloat16, torch.float16, torch.float32)
MIN_CAPABILITY = (9, 0)  # Hopper: the fp8 tensor cores the kernels are written for


def _flat(w) -> list[Tensor]:
    return list(w) if isinstance(w, Sequence) and not isinstance(w, Tensor) else [w]


def weights_key(w13, w2) -> tuple:
    """What identifies a layer's weights between calls: per tensor (each element of a list of
    per-expert weights) its storage, version counter, shape, strides and dtype; the identity
    is checked through weak references held next to the key."""
    return tuple(
        (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype, str(t.device))
        for t in _flat(w13) + _flat(w2)
    )


class Fp8State:
    """fp8 recipe, tensor scales and quantised weights of one layer's experts.

    ``recipe``: a name or a :class:`relaymoe.Fp8Recipe`. ``quantizations`` counts the weight
    quantisations (one per optimizer step when the cache serves the micro-batches). Delayed
    scaling's histories: ``scales.state_dict()`` / ``load_state_dict``."""

    def __init__(self, recipe: str | Fp8Recipe = "tensorwise"):
        resolved = as_fp8_recipe(recipe)
        if resolved is None:
            raise ValueError("Fp8State needs a recipe (a name or a relaymoe.Fp8Recipe), not None")
        self.recipe = resolved
        self.scales = scaling_for(resolved)
        self.quantizations = 0
        self._key: tuple | None = None
        self._refs: list = []
        self._weights: Fp8ExpertWeights | None = None

    def roles(self) -> dict[str, str]:
        """The tensors a delayed-scaling state keeps a history for, with their fp8 format
        (``kernels/fp8/hop.py``: x and ``a`` e4m3, dy and dh the gradients' format, ``pa``
        e4m3); empty for the recipes without state."""
        if self.recipe.recipe != "delayed":
            return {}
        grad = self.recipe.grad_format
        return {"x": "e4m3", "a": "e4m3", "dy": grad, "dh": grad, "pa": "e4m3"}

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the recipe's name and format, and delayed scaling's
        histories (CPU fp32; empty for the other recipes, whose scales come from the tensors
        themselves). The fp8 weight copies are not kept: they are quantised again."""
        hist = {} if self.recipe.recipe != "delayed" else {
            r: h.detach().cpu() for r, h in self.scales.history.items()}  # fmt: skip
        return {"recipe": self.recipe.recipe, "fmt": self.recipe.fmt, "history": hist}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s histories (``ValueError`` for another recipe or a
        history of another length); the next scales are computed from them."""
        if (state.get("recipe"), state.get("fmt")) != (self.recipe.recipe, self.recipe.fmt):
            raise ValueError(
                f"fp8 state of recipe {state.get('recipe')!r}/{state.get('fmt')!r} cannot be "
                f"loaded into a {self.recipe.recipe!r}/{self.recipe.fmt!r} layer: resume with "
                "the saving run's --fp8-recipe and --fp8-format"
            )
        roles = self.roles()
        for role, hist in state.get("history", {}).items():
            if role not in roles or hist.shape != (self.recipe.amax_history_len,):
                raise ValueError(
                    f"fp8 state: history {role!r} of shape {tuple(hist.shape)}; this layer "
                    f"keeps {tuple(roles)} of length {self.recipe.amax_history_len} "
                    "(--fp8-amax-history-len): resume with the saving run's value"
                )
            self.scales.set_history(role, hist.float().clone(), roles[role])

    def agree_histories(self, group, device) -> None:
        """Delayed scaling: every history replaced by its maximum over ``group`` (one
        all-reduce of every role's history, roles a rank has not seen yet as zeros), so the
        ranks of an EP group hold the same histories and scales and a checkpoint of any one
        resumes at any EP. A no-op for the other recipes."""
        import torch.distributed as dist

        roles = self.roles()
        if not roles:
            return
        n = self.recipe.amax_history_len
        hist = self.scales.history
        stacked = torch.stack([hist[r].to(device) if r in hist else
                               torch.zeros(n, device=device) for r in roles])  # fmt: skip
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
        for j, (role, fmt) in enumerate(roles.items()):
            self.scales.set_history(role, stacked[j].clone(), fmt)

    def invalidate(self) -> None:
        """Forget the quantised weights (the next call quantises again)."""
        self._key, self._refs, self._weights = None, [], None

    def cached(self, originals) -> Fp8ExpertWeights | None:
        """The fp8 copy quantised from ``originals`` (the weights as the caller passes them:
        ``(w13, w2)``, tensors or lists) when they are still the same tensors at the same
        storage and version, else None: a caller holding per-expert lists stacks them only
        when this misses."""
        tensors = _flat(originals[0]) + _flat(originals[1])
        alive = len(self._refs) == len(tensors) and all(
            r() is t for r, t in zip(self._refs, tensors, strict=True)
        )
        if self._weights is None or not alive or weights_key(*originals) != self._key:
            return None
        return self._weights

    def expert_weights(self, w13: Tensor, w2: Tensor, originals=None) -> Fp8ExpertWeights:
        """The fp8 copy of ``w13``/``w2`` (stacked), cached while ``originals`` (the weights as
        the caller passed them: tensors or lists; default the stacked ones) are the same
        tensors at the same version."""
        originals = (w13, w2) if originals is None else originals
        hit = self.cached(originals)
        if hit is not None:
            return hit
        self._weights = quantize_expert_weights(w13.detach(), w2.detach(), self.recipe)
        self._key = weights_key(*originals)
        self._refs = [weakref.ref(t) for t in _flat(originals[0]) + _flat(originals[1])]
        self.quantizations += 1
        return self._weights


def resolve_fp8(fp8) -> Fp8State | None:
    """``moe_experts``' ``fp8=``: None, a recipe name, an ``Fp8Recipe`` (a fresh state: weights
    quantised in this call) or an :class:`Fp8State` (kept by the caller). Delayed scaling keeps
    an amax history between calls, so it needs the caller's state."""
    if fp8 is None or isinstance(fp8, Fp8State):
        return fp8
    recipe = as_fp8_recipe(fp8)
    if recipe.recipe == "delayed":
        raise ValueError(
            "fp8='delayed' scales each tensor from the amax history of earlier calls, which must "
            "outlive this call: pass fp8=relaymoe.Fp8State('delayed') and reuse it every step"
        )
    return Fp8State(recipe)


def _check_device(x: Tensor) -> None:
    from relaymoe.kernels import interpret_mode, triton_available

    if not triton_available():
        raise ValueError("fp8 experts run Triton kernels and triton does not import; use fp8=None")
    if x.device.type == "cpu":
        if not interpret_mode():
            raise ValueError(
                "fp8 experts run Triton kernels: on a CPU device only under Triton's "
                "interpreter (TRITON_INTERPRET=1, set before triton is imported); the inputs are "
                "on cpu: move them to a Hopper GPU, or use fp8=None"
            )
        return
    if x.device.type != "cuda":
        raise ValueError(f"fp8 experts need a CUDA device (Hopper), the inputs are on {x.device}")
    problem = capability_problem(
        torch.cuda.get_device_capability(x.device), torch.cuda.get_device_name(x.device)
    )
    if problem is not None:
        raise ValueError(problem)


def capability_problem(cap: tuple[int, int], name: str) -> str | None:
    """Why a GPU of compute capability ``cap`` cannot run the fp8 kernels (None: it can)."""
    if tuple(cap) >= MIN_CAPABILITY:
        return None
    return (
        f"fp8 experts need a Hopper GPU (compute capability 9.0, sm90) or newer: {name} has "
        f"capability {cap[0]}.{cap[1]} (sm{cap[0]}{cap[1]}), without the fp8 tensor cores the "
        "kernels use; use fp8=None (bf16)"
    )


def check_fp8_call(state: Fp8State, x: Tensor, w13: Tensor, w2: Tensor, *, backend: str,
                   b13=None, b2=None) -> None:  # fmt: skip
    """``ValueError`` naming the value, the limit and the fix for an fp8 call the kernels cannot
    honour: the backend, the device (CPU without the interpreter, a GPU before Hopper), the
    dtype, biases, and for blockwise H and I not multiples of 128."""
    if backend == "torch":
        raise ValueError(
            "fp8 experts run on the Triton kernels; backend='torch' computes in the inputs' "
            "dtype: use backend='auto' or 'triton', or fp8=None"
        )
    _check_device(x)
    if x.dtype not in FP8_DTYPES_IN:
        raise ValueError(
            f"fp8 experts quantise from {', '.join(str(d) for d in FP8_DTYPES_IN)}; x is "
            f"{x.dtype}: cast x, w13 and w2 to bfloat16 (or use fp8=None for {x.dtype})"
        )
    if b13 is not None or b2 is not None:
        raise ValueError("fp8 experts take no fc1/fc2 biases (b13, b2) yet; use fp8=None for "
                         "expert MLPs with biases")  # fmt: skip
    if state.recipe.blockwise:
        hidden, ffn = x.shape[1], w2.shape[2]
        for name, value in (("H (hidden size)", hidden), ("I (expert FFN size)", ffn)):
            if value % BLOCK:
                raise ValueError(
                    f"fp8 recipe 'blockwise' quantises in {BLOCK}-wide blocks: {name} = {value} "
                    f"is not a multiple of {BLOCK}; pad it to {-(-value // BLOCK) * BLOCK}, or "
                    "use fp8='tensorwise' (any size)"
                )
