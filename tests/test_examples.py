"""The newcomer's path: scripts/cpu_demo.py and examples/qwen3/train.sh's checks (no GPU).

* the CPU demo runs the Triton kernels (interpreter) and ring_moe (gloo, 2 processes) against
  the oracle, prints PASS per check and exits 0; a wrong result prints FAIL and exits 1;
* train.sh parses (``bash -n``), and refuses before launching anything: a config whose layout
  does not fill NNODES x GPUS_PER_NODE, CP > 1 without TransformerEngine, a missing Python.
  A stand-in ``PYTHON`` logs every call and answers the launch itself, so that "nothing was
  launched" is observed, not assumed. With ``DRY_RUN=1`` it prints the command, whose flags
  Megatron's parser accepts.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "scripts" / "cpu_demo.py"
TRAIN = ROOT / "examples" / "qwen3" / "train.sh"
LAUNCH = "torch.distributed.run"


def _env(**kw) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    for k in ("NNODES", "GPUS_PER_NODE", "DRY_RUN", "PYTHON", "DATA_PATH", "MEGATRON_LM_DIR"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in kw.items()})
    return env


# --------------------------------------------------------------------------------- cpu demo
def _load_demo(monkeypatch):
    spec = importlib.util.spec_from_file_location("cpu_demo", DEMO)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "cpu_demo", mod)  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_cpu_demo_passes_against_the_oracle():
    p = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True,
                       timeout=300, env=_env(), cwd=ROOT)  # fmt: skip
    out = p.stdout
    assert p.returncode == 0, out + p.stderr[-3000:]
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(("PASS ", "FAIL "))]
    assert lines and all(ln.startswith("PASS ") for ln in lines), out
    assert any("Triton fp32" in ln and "dw13" in ln for ln in lines), out
    for mode in ("expert", "token"):
        for rank in (0, 1):
            assert any(f"{mode} mode, rank {rank}: dprobs" in ln for ln in lines), out
    assert any("bitwise equal" in ln for ln in lines), out
    assert f"PASS: all {len(lines)} checks" in out


def test_cpu_demo_reports_a_wrong_result_as_fail(monkeypatch, capsys):
    """moe_experts made 0.1% wrong: the Triton check says FAIL with the error, main() returns 1."""
    demo = _load_demo(monkeypatch)
    import relaymoe.experts

    real = relaymoe.experts.moe_experts

    def wrong(*a, **k):
        return real(*a, **{**k, "backend": "torch"}) * 1.001

    monkeypatch.setattr(relaymoe.experts, "moe_experts", wrong)
    checks = demo.check_triton_experts()
    assert checks and not any(c.ok for c in checks if c.name.endswith("output"))
    assert all(0.5e-3 < c.err < 2e-3 for c in checks if c.name.endswith("output"))
    monkeypatch.setattr(demo, "check_routing", lambda: [demo.Check("r", 0.0, 0.0)])
    monkeypatch.setattr(demo, "check_ring", lambda: [demo.Check("ring", float("nan"), 1e-5)])
    assert demo.main() == 1
    out = capsys.readouterr().out
    assert "FAIL  moe_experts Triton fp32" in out and "FAIL  ring" in out
    assert "FAIL: " in out and "PASS: all" not in out


# ---------------------------------------------------------------------------------- train.sh
def test_train_sh_parses():
    subprocess.run(["bash", "-n", str(TRAIN)], check=True)


def _shim(tmp_path: Path, *, te: bool) -> tuple[Path, Path]:
    """A PYTHON that logs its arguments, answers ``import transformer_engine`` as told, reports
    a launch instead of doing it, and runs everything else with this interpreter."""
    log = tmp_path / "calls.log"
    shim = tmp_path / "python"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {shlex.quote(str(log))}\n'
        'if [ "$1" = -c ] && [[ "$2" == *transformer_engine* ]]; then exit '
        f"{0 if te else 1}; fi\n"
        f'if [ "$1" = -m ] && [ "$2" = {LAUNCH} ]; then echo LAUNCHED; exit 0; fi\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    shim.chmod(0o755)
    return shim, log


def _train(tmp_path, config, *, te=False, **env):
    shim, log = _shim(tmp_path, te=te)
    p = subprocess.run(["bash", str(TRAIN), config], capture_output=True, text=True, timeout=120,
                       env=_env(PYTHON=shim, **env), cwd=tmp_path)  # fmt: skip
    calls = log.read_text().splitlines() if log.exists() else []
    return p, calls


def test_train_sh_refuses_a_world_that_does_not_match_before_launching(tmp_path):
    p, calls = _train(tmp_path, "qwen3_30b_a3b", te=True, NNODES=1, GPUS_PER_NODE=2)
    assert p.returncode != 0
    assert "needs tp*cp*pp*dp = 2*4*4*1 = 32 GPUs, but the job has 2" in p.stderr, p.stderr
    assert "nothing was launched" in p.stderr and "Traceback" not in p.stderr
    assert "LAUNCHED" not in p.stdout and not any(LAUNCH in c for c in calls), calls


def test_train_sh_refuses_cp_without_transformer_engine_with_the_fix(tmp_path):
    p, calls = _train(tmp_path, "qwen3_30b_a3b", te=False, NNODES=4, GPUS_PER_NODE=8)
    assert p.returncode != 0
    assert "CP=4" in p.stderr and "TransformerEngine" in p.stderr and "fix:" in p.stderr
    assert "[te]" in p.stderr and "parallel.cp: 1" in p.stderr, p.stderr
    assert "LAUNCHED" not in p.stdout and not any(LAUNCH in c for c in calls), calls


def test_train_sh_launches_when_the_checks_pass(tmp_path):
    """The positive control of the refusals: same stand-in, a matching world, TE present."""
    p, calls = _train(tmp_path, "qwen3_30b_a3b", te=True, NNODES=4, GPUS_PER_NODE=8)
    assert p.returncode == 0 and "LAUNCHED" in p.stdout, p.stderr
    launch = [c for c in calls if LAUNCH in c]
    assert len(launch) == 1 and "--context-parallel-size 4" in launch[0]
    assert "--transformer-impl local" not in launch[0]


def test_train_sh_refuses_a_missing_python(tmp_path):
    p = subprocess.run(["bash", str(TRAIN), "tiny_qwen3"], capture_output=True, text=True,
                       timeout=60, env=_env(PYTHON=tmp_path / "nope"))  # fmt: skip
    assert p.returncode != 0 and "no Python at" in p.stderr and "scripts/test.sh" in p.stderr


def test_train_sh_defaults_to_the_project_venv():
    p = subprocess.run(["bash", str(TRAIN), "tiny_qwen3"], capture_output=True, text=True,
                       timeout=120, env=_env(DRY_RUN=1, NNODES=1, GPUS_PER_NODE=1))  # fmt: skip
    venv = ROOT / ".venv" / "bin" / "python"
    if venv.exists():
        assert p.returncode == 0, p.stderr
        assert shlex.split(p.stdout)[0] == str(venv)
    else:  # the checkout's environment lives elsewhere (RELAYMOE_VENV): then it says so
        assert p.returncode != 0 and f"no Python at {venv}" in p.stderr


def test_train_sh_dry_run_flags_parse_with_megatron(tmp_path):
    pytest.importorskip("megatron.training.arguments")
    p, calls = _train(tmp_path, "tiny_qwen3", DRY_RUN=1, NNODES=1, GPUS_PER_NODE=1)
    assert p.returncode == 0, p.stderr
    assert not any(LAUNCH in c for c in calls)  # printed, not run
    argv = shlex.split(p.stdout)
    assert argv[1:3] == ["-m", LAUNCH]
    flags = argv[argv.index("relaymoe.megatron.pretrain") + 1 :]
    from megatron.training import arguments

    import relaymoe.megatron as rm

    rm.register()
    ns = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    a = ns.parse_args(flags)
    assert a.moe_token_dispatcher_type == "ring" and a.num_experts == 8 and a.mock_data
    assert a.transformer_impl == "local"  # the stand-in says TransformerEngine is missing
