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


# ------------------------------------------- no traceback, no noise from any subcommand (#52)
def test_plan_flags_and_version_print_no_warning_on_a_cpu_machine():
    """Item 14: nothing on stderr but what the user must act on (here: nothing)."""
    for args in (["--version"], ["flags"], ["plan"]):
        p = _run("-m", "relaymoe", *args)
        assert p.returncode == 0 and p.stderr == "", (args, p.stderr)


def test_a_closed_pipe_ends_the_output_quietly():
    """Item 9: ``relaymoe flags | head -5`` gave a BrokenPipeError traceback: the reader is
    gone before the command writes (the read end closed at once)."""
    import os

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    p = subprocess.Popen([sys.executable, "-m", "relaymoe", "flags"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, cwd=ROOT)  # fmt: skip
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == "", err


def test_convert_hf_with_an_unknown_config_is_one_line(tmp_path, capsys):
    """Item 9: ``--config no_such_config`` raised a ValueError traceback."""
    import json

    from relaymoe.cli import main

    hf = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64,
          "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32, "vocab_size": 256}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    rc = main(["convert-hf", "--hf", str(tmp_path), "--out", str(tmp_path / "o"), "--config",
               "no_such_config"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("relaymoe convert-hf: error: --config no_such_config: config ")
    (tmp_path / "config.json").write_text("{not json")
    rc = main(["convert-hf", "--hf", str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "config.json: not JSON" in err and err.count("\n") == 1, err


def test_the_command_line_turns_interrupts_and_file_errors_into_one_line(monkeypatch, capsys):
    """The ``relaymoe`` command's last resort: Ctrl-C is exit 130, a file it cannot read or
    write exit 2, each one line naming the command (and the path)."""
    from relaymoe import cli

    def interrupted(ns):
        raise KeyboardInterrupt

    def unreadable(ns):
        raise PermissionError(13, "Permission denied", "/data/x.jsonl")

    for fake, rc, line in ((interrupted, 130, "relaymoe flags: interrupted\n"),
                           (unreadable, 2, "relaymoe flags: error: Permission denied: "
                                           "/data/x.jsonl\n")):  # fmt: skip
        monkeypatch.setattr(cli, "_flags", fake)
        assert cli.main(["flags"]) == rc
        assert capsys.readouterr().err == line
