"""relaymoe: ring-based, index-fused Mixture-of-Experts execution for Megatron-LM.

Public API (imported lazily so ``import relaymoe`` stays cheap and never imports Megatron):
``build_routing_index``, ``RoutingIndex``, ``moe_experts``, ``ring_moe``,
``moe_experts_reference``, ``linear_cross_entropy``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "RoutingIndex": "relaymoe.routing",
    "build_routing_index": "relaymoe.routing",
    "moe_experts_reference": "relaymoe.reference",
    "moe_experts": "relaymoe.experts",
    "ring_moe": "relaymoe.ring",
    "linear_cross_entropy": "relaymoe.loss",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'relaymoe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
