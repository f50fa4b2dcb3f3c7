"""Loading a config: a path or a shipped name (``configs/``) to a validated ``Config``.

``config_from_dict`` checks the sections, the keys and the YAML types of every value (``checks``)
before the schema's own checks run.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from relaymoe.config.checks import check_keys, coerce
from relaymoe.config.schema import SECTIONS, Config

# shipped with the package (the checkout's configs/ links here), so bare names resolve in a wheel
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# YAML keys accepted as spellings of a field (TransformerConfig names for the same Megatron arg).
_MODEL_ALIASES = {"num_moe_experts": "num_experts"}


def resolve_config_path(path_or_name: str | os.PathLike) -> Path:
    """A path to a YAML file, or a bare name (``qwen3_30b_a3b``, ``table3/e64``) in configs/."""
    p = Path(path_or_name)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / p, CONFIG_DIR / f"{p}.yaml", CONFIG_DIR / f"{p}.yml"):
        if cand.is_file():
            return cand
    known = sorted(str(q.relative_to(CONFIG_DIR))[:-5] for q in CONFIG_DIR.rglob("*.yaml"))
    raise ValueError(f"config {str(path_or_name)!r} not found (no such file); known names: {known}")


def load_config(path_or_name: str | os.PathLike) -> Config:
    path = resolve_config_path(path_or_name)
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    rp = path.resolve()
    name = (
        str(rp.relative_to(CONFIG_DIR).with_suffix(""))
        if rp.is_relative_to(CONFIG_DIR)
        else path.stem
    )
    try:
        return config_from_dict(data, name=name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# The sections every config has; the others of SECTIONS (relaymoe:) are optional.
REQUIRED_SECTIONS = ("model", "parallel", "training")


def config_from_dict(data: Any, name: str = "") -> Config:
    if not isinstance(data, dict):
        shown = repr(data) if len(repr(data)) <= 80 else repr(data)[:77] + "..."
        raise ValueError(f"a config is a mapping with sections {sorted(SECTIONS)}, got {shown}")
    unknown = set(data) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown config section(s) {sorted(unknown)}; known: {sorted(SECTIONS)}")
    missing = [sec for sec in REQUIRED_SECTIONS if sec not in data]
    if missing:
        optional = [sec for sec in SECTIONS if sec not in REQUIRED_SECTIONS]
        raise ValueError(
            f"config has no {', '.join(map(repr, missing))} section{'s' * (len(missing) > 1)}; "
            f"add {'it' if len(missing) == 1 else 'them'} (required: "
            f"{', '.join(REQUIRED_SECTIONS)}; optional: {', '.join(optional)})"
        )
    kw = {}
    for sec, cls in SECTIONS.items():
        raw = data.get(sec) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"section {sec!r} must be a mapping, got {raw!r}")
        if sec == "model":
            raw = {_MODEL_ALIASES.get(k, k): v for k, v in raw.items()}
        check_keys(sec, raw, cls)
        missing = [
            f.name
            for f in fields(cls)
            if f.name not in raw
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ValueError(f"section {sec!r} misses required key(s) {missing}")
        kw[sec] = cls(**coerce(sec, raw, cls))
    return Config(name=name, **kw)
