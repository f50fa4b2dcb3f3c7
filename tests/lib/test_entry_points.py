"""What a new user types first: ``relaymoe --version``, ``relaymoe --help``, the lazy package
API (``relaymoe.reference`` after a plain ``import relaymoe``, nothing heavy imported), and
``python -m relaymoe.megatron.pretrain --help`` (megatron-core 0.19.2's help text has a stray
``%`` that made argparse raise)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, timeout=120):
    import os

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)  # fmt: skip


def test_version_matches_the_package_metadata():
    import relaymoe

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    p = _run("-m", "relaymoe", "--version")
    assert p.returncode == 0 and p.stdout.strip() == f"relaymoe {declared}", p
    assert relaymoe.__version__ == declared


def test_help_lists_every_subcommand_and_imports_nothing_heavy():
    p = _run("-m", "relaymoe", "--help")
    assert p.returncode == 0
    for cmd in ("plan", "flags", "data", "convert-hf", "export-hf", "check-hf"):
        assert cmd in p.stdout, p.stdout
    code = (
        "import sys, relaymoe.cli; relaymoe.cli._parser();"
        "heavy = [m for m in ('torch', 'megatron', 'transformers', 'triton') if m in sys.modules];"
        "print(heavy)"
    )
    p = _run("-c", code)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_submodules_are_reachable_after_import_relaymoe():
    code = (
        "import sys, relaymoe; assert 'torch' not in sys.modules;"
        "f = relaymoe.reference.moe_experts_reference; assert callable(f);"
        "assert relaymoe.moe_experts_reference is f; assert 'reference' in dir(relaymoe);"
        "assert relaymoe.config.load_config; print('OK')"
    )
    p = _run("-c", code)
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stderr
    import relaymoe

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        relaymoe.nope  # noqa: B018


def test_escape_help_percents_leaves_argparse_placeholders():
    import argparse

    from relaymoe.megatron.patches import escape_help_percents

    p = argparse.ArgumentParser()
    p.add_argument("--a", help="headroom (e.g. 1.10 = 10%)")
    p.add_argument("--b", default=3, help="10%% of it, default %(default)s")
    assert escape_help_percents(p) == ["a"]
    text = p.format_help()
    assert "1.10 = 10%)" in text and "10% of it, default 3" in text


def test_pretrain_help_works():
    """The parser ``python -m relaymoe.megatron.pretrain`` builds (Megatron's, patched by
    ``register()``, plus pretrain's own group) formats its whole help."""
    pytest.importorskip("megatron.training")
    import argparse

    from megatron.training import arguments

    from relaymoe.megatron import register
    from relaymoe.megatron.pretrain import extra_args

    register()
    parser = extra_args(arguments.add_megatron_arguments(argparse.ArgumentParser()))
    text = parser.format_help()
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text and "= 10%)" in text
    assert "--relaymoe-mode" in text and "--relaymoe-report" in text
