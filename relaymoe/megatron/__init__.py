"""relaymoe inside Megatron: ``--moe-token-dispatcher-type ring``.

``register()`` (idempotent, imports Megatron only when called) patches megatron-core 0.19 so
that its argument parser accepts ``ring`` plus relaymoe's own flags, ``TransformerConfig``
refuses what the ring cannot run, and ``MoELayer`` builds a ``RingDispatcher`` whose experts run
through ``relaymoe.ring.ring_moe`` with the layer's own expert parameters; with
``--relaymoe-fused-loss`` ``GPTModel`` computes its output layer + loss through
``relaymoe.linear_cross_entropy`` without the logits; where apex is not installed, Megatron's
``--gradient-accumulation-fusion`` (its default) runs through a torch stand-in for apex's
extension (``wgrad_fallback.py``) instead of refusing to build. See
``relaymoe/megatron/patches.py`` for exactly what is patched. The ring's options are one
``relaymoe.options.RingConfig`` per dispatcher, built from Megatron's arguments
(``--relaymoe-*`` flags over the ``RELAYMOE_*`` environment, read once when the arguments are
validated) or attached to a ``TransformerConfig`` by ``configure(config, ring=...,
fused_loss=...)`` (``settings.py``); registering changes no option.

Entry points: ``python -m relaymoe.megatron.launch PATH/pretrain_gpt.py <args>`` (registers,
then runs your script) and ``python -m relaymoe.megatron.pretrain <args>`` (self-contained).
"""

from __future__ import annotations

import importlib

__all__ = [
    "register",
    "is_registered",
    "configure",
    "RingDispatcher",
    "check_ring_config",
    "check_ring_args",
    "add_relaymoe_args",
]

_REGISTERED_MARK = "__relaymoe_registered__"

_LAZY = {
    "RingDispatcher": "relaymoe.megatron.dispatcher",
    "check_ring_config": "relaymoe.megatron.validate",
    "check_ring_args": "relaymoe.megatron.validate",
    "configure": "relaymoe.megatron.settings",
    "add_relaymoe_args": "relaymoe.megatron.patches",
}


def is_registered() -> bool:
    """True once ``register()`` has patched this process's megatron-core."""
    try:
        import megatron.core as mcore
    except ImportError:
        return False
    return bool(getattr(mcore, _REGISTERED_MARK, False))


def register() -> None:
    """Make megatron-core accept ``--moe-token-dispatcher-type ring``; safe to call twice."""
    import megatron.core as mcore

    if getattr(mcore, _REGISTERED_MARK, False):
        return
    version = getattr(mcore, "__version__", "0")
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < (0, 19):
        raise RuntimeError(
            f"relaymoe.megatron needs megatron-core >= 0.19, found {version}; "
            f"fix: pip install 'megatron-core>=0.19'"
        )
    from relaymoe.megatron import patches, wgrad_fallback

    wgrad_fallback.install()  # only where apex's extension is missing (its docstring: why)
    patches.patch_transformer_config()
    patches.patch_moe_layer()
    patches.patch_gpt_model()
    try:
        patches.patch_arguments()
        patches.patch_checkpoint_loading()
        patches.patch_train_step()
    except ImportError:  # megatron.training absent (core-only install): nothing to parse or load
        pass
    setattr(mcore, _REGISTERED_MARK, True)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'relaymoe.megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
