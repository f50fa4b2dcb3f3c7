"""Model / parallel / training configuration: schema, YAML loader and Megatron CLI rendering.

A config file (``configs/*.yaml``) has the sections ``model:``, ``parallel:``, ``training:`` and an
optional ``relaymoe:``. Keys in ``model:`` and ``training:`` are Megatron argument names in
snake_case (``num_layers`` is ``--num-layers``), so ``to_megatron_args`` is a mechanical rendering.
``parallel:`` uses short names (``tp``, ``cp``, ``pp``, ``vpp``, ``ep``, ``etp``, ``dp``).

Everything is validated when loaded: unknown keys, wrong types, and parallel sizes that do not
divide the world or the model raise ``ValueError`` naming the value, the limit and the fix.
Nothing here imports torch or Megatron.

The modules: ``schema`` (the sections), ``checks`` (the type checks of their values), ``layout``
(the parallel sizes against the model), ``load`` (YAML files and dicts), ``megatron_args`` (the
Megatron flags).
"""

from relaymoe.config.layout import validate_layout
from relaymoe.config.load import CONFIG_DIR, config_from_dict, load_config, resolve_config_path
from relaymoe.config.megatron_args import (
    flag_groups,
    max_positions,
    megatron_namespace,
    megatron_notes,
    recompute_args,
    to_megatron_args,
)
from relaymoe.config.schema import (
    DISPATCHERS,
    NORMALIZATION_IMPLS,
    RECOMPUTE_MODULES,
    Config,
    ModelConfig,
    ParallelConfig,
    RelayMoEConfig,
    TrainingConfig,
)

__all__ = [
    "CONFIG_DIR",
    "DISPATCHERS",
    "NORMALIZATION_IMPLS",
    "RECOMPUTE_MODULES",
    "Config",
    "ModelConfig",
    "ParallelConfig",
    "RelayMoEConfig",
    "TrainingConfig",
    "config_from_dict",
    "flag_groups",
    "load_config",
    "max_positions",
    "megatron_namespace",
    "megatron_notes",
    "recompute_args",
    "resolve_config_path",
    "to_megatron_args",
    "validate_layout",
]
