"""The newcomer's path: scripts/cpu_demo.py and examples/qwen3/train.sh's checks (no GPU).

* the CPU demo runs the Triton kernels (interpreter) and ring_moe (gloo, 2 processes) against
  the oracle, prints PASS per check and exits 0; a wrong result prints FAIL and exits 1;
* train.sh parses (``bash -n``), and refuses before launching anything: a config whose layout
  does not fill NNODES x GPUS_PER_NODE (reported once, as itself), CP > 1 without
  TransformerEngine, a missing Python, NODE_RANK >= NNODES, a DATA_PATH without its files, an
  extra argument Megatron's parser refuses, several nodes without MASTER_ADDR, a real launch
  on a host without GPUs (the last two: one line, nothing left behind; issue #52). A stand-in
  ``PYTHON`` logs every call, answers the count of visible GPUs and the launch itself, so that
  "nothing was launched" is observed, not assumed, and runs the other calls (the preflight, which
  imports Megatron) forked from the forkserver that has imported it (``tests.python_relay``);
  the refusal on a host without GPUs runs them in a fresh interpreter (its one line: the
  preflight quiets the warnings of its imports). With
  ``DRY_RUN=1`` it prints the command, whose flags Megatron's parser accepts, and what the run
  needs (TransformerEngine for CP 4) without having it; with real data it passes the dataset,
  the tokenizer and the config's vocabulary; with SAVE_DIR and no TE it adds what resuming
  needs;
* table3.sh exits non-zero when a run fails; slurm.sbatch refuses to run outside SLURM,
  passes extra arguments through srun unchanged (spaces included) and takes GPUS_PER_NODE
  from the allocation unless it is set.
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

from tests.python_relay import PythonRelay

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "scripts" / "cpu_demo.py"
TRAIN = ROOT / "examples" / "qwen3" / "train.sh"
LAUNCH = "torch.distributed.run"


def _env(**kw) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    for k in (
        "NNODES",
        "GPUS_PER_NODE",
        "DRY_RUN",
        "PYTHON",
        "DATA_PATH",
        "MEGATRON_LM_DIR",
        "NODE_RANK",
        "TOKENIZER",
        "SAVE_DIR",
        "PRETRAINED",
        "SLURM_JOB_ID",
        "SLURM_JOB_NUM_NODES",
        "SLURM_JOB_NODELIST",
        "SLURM_NODEID",
        "SLURM_GPUS_ON_NODE",
        "SLURM_GPUS_PER_NODE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
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


def _shim(tmp_path: Path, *, te: bool, gpus: int = 0, python: str = sys.executable):
    """A PYTHON that logs its arguments, answers ``import transformer_engine`` and the count of
    visible GPUs as told, reports a launch instead of doing it, and runs everything else with
    ``python``; (the stand-in, its log)."""
    log = tmp_path / "calls.log"
    shim = tmp_path / "python"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {shlex.quote(str(log))}\n'
        'if [ "$1" = -c ] && [[ "$2" == *transformer_engine* ]]; then exit '
        f"{0 if te else 1}; fi\n"
        f'if [ "$1" = -c ] && [[ "$2" == *device_count* ]]; then echo {gpus}; exit 0; fi\n'
        f'if [ "$1" = -m ] && [ "$2" = {LAUNCH} ]; then echo LAUNCHED; exit 0; fi\n'
        f'exec {shlex.quote(str(python))} "$@"\n'
    )
    shim.chmod(0o755)
    return shim, log


def _train(tmp_path, config, *extra, te=False, gpus=0, fresh=False, **env):
    """train.sh CONFIG EXTRA with the stand-in PYTHON (``_shim``) and the environment ``env``:
    (the finished process, the stand-in's calls). The Python calls the stand-in passes on run
    forked from the forkserver that has imported Megatron (``PythonRelay``), or, ``fresh``, in
    a fresh interpreter (a test of what the preflight prints as the command line runs it)."""
    cmd, kw = ["bash", str(TRAIN), config, *extra], dict(timeout=120, cwd=tmp_path)
    if fresh:
        shim, log = _shim(tmp_path, te=te, gpus=gpus)
        p = subprocess.run(cmd, capture_output=True, text=True, env=_env(PYTHON=shim, **env), **kw)
    else:
        with PythonRelay() as relay:
            shim, log = _shim(tmp_path, te=te, gpus=gpus, python=relay.python)
            p = relay.run(cmd, env=_env(PYTHON=shim, **env), **kw)
    calls = log.read_text().splitlines() if log.exists() else []
    return p, calls


def test_train_sh_refuses_a_world_that_does_not_match_before_launching(tmp_path):
    p, calls = _train(tmp_path, "qwen3_30b_a3b", te=True, NNODES=1, GPUS_PER_NODE=2)
    assert p.returncode != 0
    assert "needs tp*cp*pp*dp = 2*4*4*1 = 32 GPUs, but the job has 2" in p.stderr, p.stderr
    assert p.stderr.count("needs tp*cp*pp*dp") == 1 and "does not fit" not in p.stderr  # once
    assert "nothing was launched" in p.stderr and "Traceback" not in p.stderr
    assert "LAUNCHED" not in p.stdout and not any(LAUNCH in c for c in calls), calls


def test_train_sh_refuses_cp_without_transformer_engine_with_the_fix(tmp_path):
    p, calls = _train(tmp_path, "qwen3_30b_a3b", te=False, gpus=8, NNODES=4, GPUS_PER_NODE=8,
                      MASTER_ADDR="10.0.0.1")  # fmt: skip
    assert p.returncode == 2
    assert "(CP 4)" in p.stderr and "TransformerEngine" in p.stderr and "fix:" in p.stderr
    assert "[te]" in p.stderr and "parallel.cp: 1" in p.stderr, p.stderr
    assert "LAUNCHED" not in p.stdout and not any(LAUNCH in c for c in calls), calls


def test_train_sh_launches_when_the_checks_pass(tmp_path):
    """The positive control of the refusals: same stand-in, a matching world, TE present."""
    p, calls = _train(tmp_path, "qwen3_30b_a3b", te=True, gpus=8, NNODES=4, GPUS_PER_NODE=8,
                      MASTER_ADDR="10.0.0.1")  # fmt: skip
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


def test_train_sh_refuses_a_node_rank_outside_the_job(tmp_path):
    p, calls = _train(tmp_path, "qwen3_30b_a3b", te=True, NNODES=4, GPUS_PER_NODE=8, NODE_RANK=7)
    assert p.returncode == 2 and "NODE_RANK=7 must be an integer in [0, NNODES=4)" in p.stderr
    assert not any(LAUNCH in c for c in calls), calls


def test_dry_run_without_te_prints_the_command_and_what_it_needs(tmp_path):
    """CP 4 without TransformerEngine: the dry run still shows the launch (the TE command) and
    says what it needs, exit 0; the real run refuses (test above)."""
    p, calls = _train(tmp_path, "qwen3_30b_a3b", te=False, NNODES=4, GPUS_PER_NODE=8, DRY_RUN=1,
                      MASTER_ADDR="10.0.0.1")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "this run needs TransformerEngine (CP 4)" in p.stderr, p.stderr[-3000:]
    argv = shlex.split(p.stdout)
    assert argv[1:3] == ["-m", LAUNCH] and "--transformer-impl" not in argv
    assert argv[argv.index("--context-parallel-size") + 1] == "4"
    assert not any(LAUNCH in c and "relaymoe.megatron.preflight" not in c for c in calls[:-1])


def test_dry_run_refuses_missing_data_and_unknown_extra_arguments(tmp_path):
    p, calls = _train(tmp_path, "tiny_qwen3", "--no-such-flag", "3", DRY_RUN=1, NNODES=1,
                      GPUS_PER_NODE=1, DATA_PATH=str(tmp_path / "nope_text_document"),
                      TOKENIZER=str(tmp_path))  # fmt: skip
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"no {tmp_path}/nope_text_document.bin or" in p.stderr, p.stderr[-3000:]
    assert "unrecognized arguments: --no-such-flag 3" in p.stderr
    assert "does not load as Megatron's HuggingFaceTokenizer" in p.stderr  # an empty folder
    assert "nothing was launched" in p.stderr and not p.stdout.strip()
    p, _ = _train(tmp_path, "tiny_qwen3", DRY_RUN=1, NNODES=1, GPUS_PER_NODE=1,
                  DATA_PATH=str(tmp_path / "x"))  # fmt: skip
    assert p.returncode == 2 and "TOKENIZER is not" in p.stderr


def test_dry_run_with_real_data_and_resume_on_the_fallback(tmp_path):
    """A dataset made by ``relaymoe data``: the command carries it, its tokenizer and the
    config's vocabulary, and Megatron's parser accepts it; SAVE_DIR without TE or Apex adds
    --no-load-optim (megatron-core 0.19.2 cannot load the distributed optimizer's state there)."""
    pytest.importorskip("transformers")
    from relaymoe import data
    from tests.lib.test_data import _corpus, _train_tokenizer

    texts = _corpus(50, seed=3)
    tok = _train_tokenizer(tmp_path / "tok", texts)
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    r = data.prepare([str(tmp_path / "c.txt")], str(tmp_path / "d"), str(tok), progress=False)
    prefix = r.outputs["text"]
    p, _ = _train(tmp_path, "tiny_qwen3", DRY_RUN=1, NNODES=1, GPUS_PER_NODE=1,
                  DATA_PATH=prefix, TOKENIZER=r.tokenizer_dir,
                  SAVE_DIR=str(tmp_path / "ck"))  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    argv = shlex.split(p.stdout)
    flags = argv[argv.index("relaymoe.megatron.pretrain") + 1 :]
    for flag, value in (("--data-path", prefix), ("--tokenizer-model", r.tokenizer_dir),
                        ("--tokenizer-type", "HuggingFaceTokenizer"),
                        ("--padded-vocab-size", "1024"), ("--save", str(tmp_path / "ck")),
                        ("--load", str(tmp_path / "ck"))):  # fmt: skip
        assert flags[flags.index(flag) + 1] == value, (flag, flags)
    try:
        import apex  # noqa: F401

        has_apex = True
    except ImportError:
        has_apex = False
    assert ("--no-load-optim" in flags) == (not has_apex), flags  # the stand-in has no TE
    assert "--mock-data" not in flags


def _one_refusal(p, calls, tmp_path, *words):
    """A refused launch (issue #52): exit 2, one line naming the problem and the fix, nothing
    on stdout, nothing launched, nothing left in the working folder but the stand-in's files."""
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].endswith("; nothing was launched"), lines
    assert all(w in lines[0] for w in (*words, "fix:")), lines[0]
    assert p.stdout == "" and not any(LAUNCH in c for c in calls), calls
    assert sorted(f.name for f in tmp_path.iterdir()) == ["calls.log", "python"]


def test_a_multi_node_launch_without_master_addr_is_refused(tmp_path):
    """Item 3: NNODES=4 printed --master-addr localhost without a word."""
    p, calls = _train(tmp_path, "qwen3_30b_a3b", NNODES=4, GPUS_PER_NODE=8, DRY_RUN=1)
    _one_refusal(p, calls, tmp_path, "MASTER_ADDR is not set and NNODES=4")


def test_a_launch_on_a_host_without_gpus_is_refused_before_torchrun(tmp_path):
    """Item 8: it passed every check, then died in torchrun ("Found no NVIDIA driver")."""
    p, calls = _train(
        tmp_path, "tiny_qwen3", gpus=0, NNODES=1, GPUS_PER_NODE=1, TRAIN_ITERS=2, fresh=True
    )  # the one line of a fresh interpreter: its import warnings quiet
    _one_refusal(p, calls, tmp_path, "no GPU is visible here", "GPUS_PER_NODE=1", "DRY_RUN=1")


def test_table3_exits_non_zero_when_a_run_fails(tmp_path):
    script = ROOT / "examples" / "qwen3" / "table3.sh"
    p = subprocess.run(["bash", str(script), "k4"], capture_output=True, text=True, timeout=60,
                       env=_env(PYTHON=tmp_path / "nope"))  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    assert "2 of 2 runs failed: table3/k4:ring table3/k4:alltoall" in p.stderr


def test_slurm_sbatch_refuses_outside_slurm_and_quotes_its_arguments(tmp_path):
    script = ROOT / "examples" / "qwen3" / "slurm.sbatch"
    p = subprocess.run(["bash", str(script), "tiny_qwen3"], capture_output=True, text=True,
                       timeout=30, env=_env())  # fmt: skip
    assert p.returncode == 2 and "not inside a SLURM allocation" in p.stderr
    # inside a stand-in allocation: srun runs its command here, train.sh is a stand-in that
    # prints its arguments one per line
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    (repo / "examples" / "qwen3").mkdir(parents=True)
    bin_dir.mkdir()
    fake_train = repo / "examples" / "qwen3" / "train.sh"
    fake_train.write_text('#!/usr/bin/env bash\necho "NODE_RANK=$NODE_RANK NNODES=$NNODES '
                          'GPUS_PER_NODE=$GPUS_PER_NODE"\nprintf "%s\\n" "$@"\n')  # fmt: skip
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                  'SLURM_NODEID=0 exec "$@"\n')  # fmt: skip
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho node-a\necho node-b\n")
    for f in (fake_train, bin_dir / "srun", bin_dir / "scontrol"):
        f.chmod(0o755)
    env = _env(SLURM_JOB_ID=1, SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="node-[a-b]",
               SLURM_SUBMIT_DIR=repo, PATH=f"{bin_dir}:{os.environ['PATH']}")  # fmt: skip
    extra = ["--wandb-exp-name", "a run; with $HOME and 'quotes'", "--seed", "3"]
    p = subprocess.run(["bash", str(script), "qwen3_30b_a3b", *extra], capture_output=True,
                       text=True, timeout=30, env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "NODE_RANK=0 NNODES=2 GPUS_PER_NODE=8", lines  # the file's --gpus-per-node
    assert lines[1:] == ["qwen3_30b_a3b", *extra], lines
    # item 6 of issue #52: the allocation's GPUs per node, unless GPUS_PER_NODE says otherwise
    cases = (
        ({"SLURM_GPUS_ON_NODE": "4"}, "GPUS_PER_NODE=4"),
        ({"SLURM_GPUS_PER_NODE": "h100:4"}, "GPUS_PER_NODE=4"),
        ({"SLURM_GPUS_ON_NODE": "4", "GPUS_PER_NODE": "2"}, "GPUS_PER_NODE=2"),
    )
    for given, first in cases:
        p = subprocess.run(["bash", str(script), "qwen3_30b_a3b"], capture_output=True,
                           text=True, timeout=30, env=dict(env, **given))  # fmt: skip
        assert p.returncode == 0 and p.stdout.splitlines()[0].endswith(first), (given, p.stdout)
