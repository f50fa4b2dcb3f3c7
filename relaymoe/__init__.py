"""relaymoe: ring-based, index-fused Mixture-of-Experts execution for Megatron-LM.

Public API (imported lazily so ``import relaymoe`` stays cheap and never imports Megatron):
``build_routing_index``, ``RoutingIndex``, ``moe_experts``, ``ring_moe``,
``moe_experts_reference``, ``linear_cross_entropy``, ``ExpertActivation``, ``Fp8Recipe``,
``Fp8State`` (``moe_experts(..., fp8=...)``). The submodules
(``relaymoe.reference``, ``relaymoe.config``, ``relaymoe.megatron``, ...) are reachable as
attributes after a plain ``import relaymoe`` too; each is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "ExpertActivation": "relaymoe.activation",
    "Fp8Recipe": "relaymoe.fp8_recipe",
    "Fp8State": "relaymoe.fp8_state",
    "RoutingIndex": "relaymoe.routing",
    "build_routing_index": "relaymoe.routing",
    "moe_experts_reference": "relaymoe.reference",
    "moe_experts": "relaymoe.experts",
    "ring_moe": "relaymoe.ring",
    "linear_cross_entropy": "relaymoe.loss",
}

# submodules resolved by attribute access (``relaymoe.reference.moe_experts_reference``)
_SUBMODULES = frozenset(
    {
        "activation",
        "cli",
        "config",
        "convert_hf",
        "cost",
        "data",
        "experts",
        "kernels",
        "loss",
        "lossmodel",
        "megatron",
        "options",
        "planner",
        "reference",
        "ring",
        "routing",
    }
)

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time __getattr__ imports lazily
    from relaymoe import activation, config, megatron, reference  # noqa: F401
    from relaymoe.activation import ExpertActivation  # noqa: F401
    from relaymoe.experts import moe_experts  # noqa: F401
    from relaymoe.loss import linear_cross_entropy  # noqa: F401
    from relaymoe.reference import moe_experts_reference  # noqa: F401
    from relaymoe.ring import ring_moe  # noqa: F401
    from relaymoe.routing import RoutingIndex, build_routing_index  # noqa: F401


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"relaymoe.{name}")
    raise AttributeError(f"module 'relaymoe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
