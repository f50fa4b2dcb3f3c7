"""benchmarks/suite.py on a CPU: the real table's plan, and the orchestration of fake steps.

Fake steps are small Python scripts in a temporary folder: one that succeeds and writes its
rows, one that fails, one that overruns its limit (with a child process that must die with it),
one that needs more GPUs than the machine has, two lanes that must run at once, and a deadline
that leaves no room for a late step. The manifest they leave must be one that
``benchmarks/runs.py`` accepts.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from benchmarks import runs, suite

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ the real table
def test_table_is_consistent():
    names = [s.name for s in suite.STEPS]
    assert len(names) == len(set(names))
    for s in suite.STEPS:
        assert s.phase in suite.PHASES, s.name
        assert s.lane in ("all", "gpu0", "gpu1", "cpu"), s.name
        assert s.script.startswith("-m ") or (ROOT / s.script).is_file(), s.script
        assert (s.full_only or 0 < s.quick_s) and s.quick_s <= s.full_s, s.name
        assert (s.lane == "cpu") == (s.min_gpus == 0), s.name
    # every step of the old bash suite is still there
    old = {"ring", "ring_wide", "e2e", "ablation", "routing", "experts", "memory_model",
           "gpu_tests_kernels", "gpu_tests_dist", "memory_timeline", "scaling_sim",
           "plots"}  # fmt: skip
    assert old <= set(names)


def test_plan_on_two_gpus_quick(tmp_path):
    planned = {p.step.name: p for p in suite.plan(suite.STEPS, gpus=2, quick=True, out=tmp_path)}
    assert planned["ring_wide"].skip == "needs 3 GPUs, found 2"
    assert all(p.skip is None for n, p in planned.items() if n != "ring_wide")
    ring = planned["ring"].command
    assert ring[1:6] == ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    assert f"{tmp_path}/ring.jsonl" in ring and "--quick" in ring and "--seq" not in ring
    assert planned["experts"].env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert planned["gpu_tests_kernels"].env == {"CUDA_VISIBLE_DEVICES": "0",
                                                "RELAYMOE_AUTOTUNE": "0"}  # fmt: skip
    assert planned["gpu_tests_dist"].env == {"RELAYMOE_AUTOTUNE": "0"}
    e2e = planned["gpu_tests_e2e"].command
    assert e2e.count("--group") == 1 and "--deselect" in e2e[e2e.index("--group") + 1]
    assert "tests/gpu/test_e2e_gpu.py" not in planned["gpu_tests_dist"].command
    # the timed benchmarks keep autotuning
    for n in ("ring", "e2e", "ablation", "routing", "experts"):
        assert "RELAYMOE_AUTOTUNE" not in planned[n].env, n
    phases = [p.step.phase for p in planned.values()]
    assert phases == sorted(phases)
    # the issue-#17 GPU steps fill a call each, and the longer GPU tests: --full only
    full_only = {s.name for s in suite.STEPS if s.full_only}
    assert full_only == {"fault_nccl", "host_wait", "determinism", "soak", "e2e_pp",
                         "gpu_tests_ops", "gpu_tests_property", "gpu_tests_megatron",
                         "e2e_gbs16", "e2e_gbs16_local",
                         "max_seq_te", "e2e_sweep_gbs16", "e2e_gbs64",
                         "e2e_s16k_gbs8", "e2e_parity_gbs16", "e2e_graphed_gbs1"}  # fmt: skip
    assert not full_only & set(planned)
    text = suite.describe(list(planned.values()), deadline_s=540)
    assert "deadline 540 s" in text and "SKIP (needs 3 GPUs, found 2)" in text


def test_plan_on_one_gpu_and_full(tmp_path):
    planned = {p.step.name: p for p in suite.plan(suite.STEPS, gpus=1, quick=False, out=tmp_path)}
    for n in ("ring", "e2e", "ablation", "gpu_tests_dist"):
        assert planned[n].skip == "needs 2 GPUs, found 1", n
    assert planned["gpu_tests_e2e"].skip is None  # Megatron training at EP 1, TE and local
    assert planned["experts"].lane == "gpu0" and planned["experts"].env == {
        "CUDA_VISIBLE_DEVICES": "0"
    }
    timeline = planned["memory_timeline"]
    assert timeline.skip is None and "torch.distributed.run" not in timeline.command
    assert planned["ring"].limit_s == 540 and "--seq" in planned["ring"].command
    assert "RELAYMOE_AUTOTUNE" not in planned["gpu_tests_kernels"].env  # --full tunes
    assert planned["fault_nccl"].skip == "needs 2 GPUs, found 1"
    two = {p.step.name: p for p in suite.plan(suite.STEPS, gpus=2, quick=False, out=tmp_path,
                                              only=["fault_nccl", "soak", "e2e_pp"])}  # fmt: skip
    assert list(two) == ["fault_nccl", "soak", "e2e_pp"]
    assert "nccl" in two["fault_nccl"].command
    assert "torch.distributed.run" not in two["soak"].command  # it launches its own jobs


def test_the_gradient_accumulation_rows_are_one_step_on_one_gpu(tmp_path):
    """Issue #49's global-batch-16 rows: one GPU, the providers of bench_e2e (the same
    list), a profiled step a run, rows in the run folder, bounded inside the step's limit."""
    from benchmarks import bench_e2e

    assert suite.E2E_GBS_PROVIDERS.split(",") == list(bench_e2e.GBS_PROVIDERS)
    (p,) = suite.plan(suite.STEPS, gpus=1, quick=False, out=tmp_path, only=["e2e_gbs16"])
    cmd = list(p.command)
    assert p.skip is None and p.lane == "gpu0" and "torch.distributed.run" not in cmd
    assert cmd[cmd.index("--shapes") + 1] == "qwen3_slice_s4k_gbs16_te"
    assert cmd[cmd.index("--gpus") + 1] == "1" and "--profile-busy" in cmd
    assert cmd[cmd.index("--out") + 1] == f"{tmp_path}/e2e_gbs16.jsonl"
    assert float(cmd[cmd.index("--budget-s") + 1]) < p.limit_s
    assert bench_e2e.main([*cmd[2:-2], "--dry-run"]) == 0  # bench_e2e takes the arguments


def test_the_te_max_seq_step_runs_every_provider_and_policy_within_one_call(tmp_path, capsys):
    """Issue #53's step: max_seq.py's four TE providers (the same list) x three policies at
    EP 1, capped at an H100's usable bytes, one job per GPU; its own budget inside the step's
    limit, which fits one 10-minute call; max_seq takes the arguments (its dry run)."""
    from benchmarks import max_seq

    assert suite.MAX_SEQ_TE_PROVIDERS.split(",") == list(max_seq.TE_PROVIDERS)
    (p,) = suite.plan(suite.STEPS, gpus=8, quick=False, out=tmp_path, only=["max_seq_te"])
    cmd = list(p.command)
    assert p.skip is None and p.lane == "all" and "torch.distributed.run" not in cmd
    value = {cmd[i]: cmd[i + 1] for i in range(2, len(cmd) - 1) if cmd[i].startswith("--")}
    assert value["--policies"] == "full,selective,none" and value["--gpus"] == "1"
    assert value["--lanes"] == "all" and value["--memory-cap"] == "h100-80gb"
    assert float(value["--budget-s"]) + 30 <= p.limit_s <= 600
    assert float(value["--search-budget-s"]) < float(value["--budget-s"])
    assert value["--out"] == f"{tmp_path}/max_seq_te.jsonl"
    assert max_seq.main([*cmd[2:], "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 12 and "mcore_alltoall_te/full: planner predicts" in out


def test_plan_refuses_unknown_names(tmp_path):
    with pytest.raises(ValueError, match=r"--only names unknown step\(s\) \['rign'\]"):
        suite.plan(suite.STEPS, gpus=2, quick=True, out=tmp_path, only=["rign"])
    with pytest.raises(ValueError, match="--limit names unknown"):
        suite.plan(suite.STEPS, gpus=2, quick=True, out=tmp_path, limits={"x": 3})


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert suite.main(["--dry-run", "--gpus", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "phase 1" in text and "gpu_tests_dist" in text and "bench_experts.py" in text
    assert not out.exists()


# ------------------------------------------------------------------------------- fake steps
FAKES = {
    "ok.py": "import sys, pathlib\npathlib.Path(sys.argv[1], 'ok.jsonl').write_text('{}\\n')\n"
    "print('rows written')\n",
    "fails.py": "import sys\nprint('something broke')\nsys.exit(3)\n",
    "hangs.py": "import subprocess, sys, time, pathlib\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    # a job in a session of its own, as a test's Megatron run (torchrun) is
    "job = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
    "                       start_new_session=True)\n"
    "pathlib.Path(sys.argv[1], 'job.pid').write_text(str(job.pid))\n"
    "pathlib.Path(sys.argv[1], 'child.pid').write_text(str(child.pid))\n"
    "time.sleep(120)\n",
    "waits.py": "import sys, time, pathlib\n"  # lane A: needs lane B running at the same time
    "marker = pathlib.Path(sys.argv[1], 'b_started')\n"
    "for _ in range(300):\n"
    "    if marker.exists():\n"
    "        print('saw B'); sys.exit(0)\n"
    "    time.sleep(0.1)\n"
    "sys.exit(4)\n",
    "marks.py": "import os, sys, pathlib\n"
    "pathlib.Path(sys.argv[1], 'b_started').write_text(os.environ['CUDA_VISIBLE_DEVICES'])\n",
}


def _fakes(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name, code in FAKES.items():
        (src / name).write_text(code)
    return src


def _step(name, script, lane="cpu", phase=1, limit=60, min_gpus=None, outputs=()):
    if min_gpus is None:
        min_gpus = 0 if lane == "cpu" else 1
    return suite.Step(name, script, lane, phase, limit, limit, min_gpus=min_gpus,
                      args=("{out}",), outputs=outputs)  # fmt: skip


def _manifest(out: Path) -> dict:
    m = suite.make_manifest("python -m benchmarks.suite --test", "cpu", 1)
    m["name"] = out.name
    return m


def _run(src, out, steps, *, gpus=0, deadline_s=None, clock=time.monotonic):
    planned = suite.plan(steps, gpus=gpus, quick=True, out=out, root=src)
    s = suite.Suite(planned, out=out, manifest=_manifest(out), base_env=dict(os.environ),
                    deadline_s=deadline_s, cwd=src, clock=clock, echo=lambda m: None)  # fmt: skip
    return {o.name: o for o in s.run()}, json.loads((out / runs.MANIFEST).read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")  # a zombie is dead


def test_fake_steps_ok_failed_timeout_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "KILL_GRACE_S", 5)
    src, out = _fakes(tmp_path), tmp_path / "run"
    steps = [
        _step("ok", "ok.py", outputs=("ok.jsonl",)),
        _step("fails", "fails.py"),
        _step("hangs", "hangs.py", limit=2),
        _step("needs_gpus", "ok.py", lane="all", min_gpus=2),
        _step("absent", "nope.py"),
    ]
    got, m = _run(src, out, steps)
    assert {n: o.status for n, o in got.items()} == {
        "ok": "ok", "fails": "failed", "hangs": "timeout", "needs_gpus": "skipped",
        "absent": "skipped",
    }  # fmt: skip
    assert got["fails"].rc == 3 and "something broke" in (out / "fails.log").read_text()
    assert got["needs_gpus"].reason == "needs 2 GPUs, found 0"
    assert got["absent"].reason == "nope.py not present"
    assert "killed after the step's limit of 2 s" in (out / "hangs.log").read_text()
    child = int((out / "child.pid").read_text())
    job = int((out / "job.pid").read_text())
    try:
        for _ in range(100):  # its child goes with its group, the job in its own session too
            if not (_alive(child) or _alive(job)):
                break
            time.sleep(0.1)
        assert not _alive(child), "the timed-out step left its child process running"
        assert not _alive(job), "the timed-out step left the job it started in its own session"
    finally:
        for pid in (child, job):
            if _alive(pid):
                os.kill(pid, 9)
    # the manifest: what runs.py accepts, every step with its status, time, files, command
    runs.validate_manifest(m, "manifest")
    steps_m = {s["name"]: s for s in m["steps"]}
    assert list(steps_m) == ["ok", "fails", "hangs", "needs_gpus", "absent"]
    assert steps_m["ok"]["files"] == ["ok.jsonl", "ok.log"]
    assert steps_m["ok"]["command"] == shlex.join([sys.executable, "ok.py", str(out)])
    assert steps_m["fails"]["rc"] == 3 and steps_m["hangs"]["status"] == "timeout"
    assert steps_m["hangs"]["limit_s"] == 2 and steps_m["needs_gpus"]["seconds"] == 0
    for k in ("command", "commit", "tree_clean", "gpu", "gpus", "versions"):
        assert k in m, k


def test_lanes_of_a_phase_run_at_once_and_pin_their_gpu(tmp_path):
    """Lane gpu0's step finishes only if lane gpu1's starts while it runs (sequential lanes
    would leave it waiting until its own exit 4)."""
    src, out = _fakes(tmp_path), tmp_path / "run"
    steps = [_step("a", "waits.py", lane="gpu0"), _step("b", "marks.py", lane="gpu1")]
    got, _ = _run(src, out, steps, gpus=2)
    assert got["a"].status == "ok" and got["b"].status == "ok", (out / "a.log").read_text()
    assert (out / "b_started").read_text() == "1"  # lane gpu1 -> CUDA_VISIBLE_DEVICES=1


def test_phases_run_in_order(tmp_path):
    """b (phase 1) before a (phase 2): a then finds b's marker at once; the table order alone
    (a first) would make a wait for a marker nobody writes."""
    src, out = _fakes(tmp_path), tmp_path / "run"
    steps = [_step("a", "waits.py", lane="gpu0", phase=2), _step("b", "marks.py", lane="gpu0")]
    got, m = _run(src, out, steps, gpus=1)
    assert [s["name"] for s in m["steps"]] == ["b", "a"]
    assert got["a"].status == "ok"


def test_deadline_skips_what_no_longer_fits(tmp_path):
    """A clock that has used up the deadline after the first step: the second is skipped with
    the reason, not started."""
    src, out = _fakes(tmp_path), tmp_path / "run"
    clock = lambda: 1000.0 if (out / "ok.jsonl").exists() else 0.0  # noqa: E731
    steps = [_step("first", "ok.py", outputs=("ok.jsonl",)), _step("late", "fails.py")]
    got, m = _run(src, out, steps, deadline_s=200, clock=clock)
    assert got["first"].status == "ok"
    assert got["late"].status == "skipped" and "suite deadline 200 s reached" in got["late"].reason
    assert not (out / "late.log").exists()


def test_main_runs_a_table_and_fails_when_a_step_fails(tmp_path, monkeypatch, capsys):
    src, out = _fakes(tmp_path), tmp_path / "run"
    monkeypatch.setattr(suite, "ROOT", src)  # wheels, Triton cache, cwd: the fake tree
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(src)
    steps = [_step("ok", "ok.py", outputs=("ok.jsonl",)), _step("fails", "fails.py")]
    rc = suite.main(["--gpus", "0", "--out", str(out)], steps=steps)
    assert rc == 1
    text = capsys.readouterr().out
    assert "failed: fails\n" in text
    m = json.loads((out / runs.MANIFEST).read_text())
    assert [s["status"] for s in m["steps"]] == ["ok", "failed"]
    assert suite.main(["--gpus", "0", "--out", str(out), "--only", "ok"], steps=steps) == 0


def test_triton_cache_handoff_fits_the_cap(tmp_path):
    cache = tmp_path / "cache"
    (cache / "k1").mkdir(parents=True)
    (cache / "k1" / "kernel.cubin").write_bytes(os.urandom(64 * 1024))  # incompressible
    (cache / "k1" / "up.autotune.json").write_text(json.dumps({"configs": [1, 2, 3]}))
    run_dir = tmp_path / "2026-11-30_cpux1_0123456789ab"
    run_dir.mkdir()
    runs.write_manifest(run_dir, {**_manifest(run_dir), "steps": []})
    dest = tmp_path / "handoff"
    suite.handoff(run_dir, dest, cache)
    assert {p.name for p in dest.iterdir()} >= {"suite.tar.gz", "manifest.json"}
    import tarfile

    with tarfile.open(dest / "suite.tar.gz") as t:
        assert f"{run_dir.name}/manifest.json" in t.getnames()
    with tarfile.open(dest / "triton_cache.tar.gz") as t:  # all of it fits 15 MiB
        assert set(t.getnames()) == {"k1/kernel.cubin", "k1/up.autotune.json"}
    small = tmp_path / "small.tar.xz"
    suite.pack_triton_cache(cache, small, cap=16 * 1024)  # the kernel does not fit: tunings only
    with tarfile.open(small) as t:
        assert t.getnames() == ["k1/up.autotune.json"]


def test_tree_state_without_git(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "git_state", lambda root: (runs.UNKNOWN, runs.UNKNOWN))
    monkeypatch.delenv("RELAYMOE_COMMIT", raising=False)
    monkeypatch.delenv("RELAYMOE_TREE_CLEAN", raising=False)
    assert suite.tree_state(tmp_path)[:2] == (runs.UNKNOWN, runs.UNKNOWN)
    monkeypatch.setenv("RELAYMOE_COMMIT", "0123456789abcdef")
    assert suite.tree_state(tmp_path)[:2] == ("0123456789abcdef", runs.UNKNOWN)
    monkeypatch.setenv("RELAYMOE_TREE_CLEAN", "1")
    assert suite.tree_state(tmp_path)[:2] == ("0123456789abcdef", True)
    m = suite.make_manifest("cmd", "NVIDIA H200", 2, root=tmp_path)
    assert m["name"].endswith("_h200x2_0123456789ab") and m["tree_clean"] is True


def test_adhoc_steps_replace_the_table(tmp_path, monkeypatch):
    """``--step NAME=COMMAND``: the given steps alone, in order, with the table's manifest
    (status, command, the files named after the step); bad items name the form to use."""
    src, out = _fakes(tmp_path), tmp_path / "run"
    monkeypatch.setattr(suite, "ROOT", src)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(src)
    rc = suite.main(["--gpus", "0", "--out", str(out), "--step", "fails=fails.py",
                     "--step", "ok=ok.py {out}"])  # fmt: skip
    assert rc == 1
    m = runs.validate_manifest(json.loads((out / runs.MANIFEST).read_text()), "manifest")
    assert [(s["name"], s["status"]) for s in m["steps"]] == [("fails", "failed"), ("ok", "ok")]
    ok = m["steps"][1]
    assert ok["files"] == ["ok.jsonl", "ok.log"]
    assert ok["command"] == shlex.join([sys.executable, "ok.py", str(out)])
    (step,) = suite.adhoc_steps(["tests=-m pytest -q tests/x.py"])  # as the shell passes it
    assert step.script == "-m pytest" and step.args == ("-q", "tests/x.py")
    for bad, why in [("nocommand", "NAME=COMMAND"), ("=ok.py", "NAME=COMMAND"),
                     ("a=-m", "NAME=COMMAND")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            suite.adhoc_steps([bad])
    with pytest.raises(ValueError, match="given twice"):
        suite.adhoc_steps(["a=ok.py", "a=fails.py"])


def test_carried_wheels_versions_reach_the_manifest(tmp_path, monkeypatch):
    """The carried wheels are installed after the manifest is made, into a folder this process
    does not search: their versions must still be recorded (a device run once wrote
    ``megatron-core: unknown`` with megatron-core 0.19.2 installed)."""
    site = tmp_path / "site"
    info = site / "megatron_core-9.8.7.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 9.8.7\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # record_versions puts the site first
    src, out = _fakes(tmp_path), tmp_path / "run"
    monkeypatch.setattr(suite, "ROOT", src)
    monkeypatch.setattr(suite, "install_wheels", lambda root, log: site)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(src)
    assert suite.main(["--gpus", "0", "--out", str(out), "--step", "ok=ok.py {out}"]) == 0
    m = runs.validate_manifest(json.loads((out / runs.MANIFEST).read_text()), "manifest")
    assert m["versions"]["megatron-core"] == "9.8.7"


def test_two_calls_at_one_commit_unpack_to_two_runs(tmp_path):
    """Device calls at the same commit and date return run folders of the same name; ``unpack``
    keeps both (the second as ``<name>-2``, its manifest renamed) and each reads back as a run."""
    import tarfile

    name = "2026-12-02_h200x1_b3040c6e8818"
    results = tmp_path / "results"
    results.mkdir()
    archives = []
    for call in (1, 2):
        src = tmp_path / f"call{call}" / name
        src.mkdir(parents=True)
        m = runs.new_manifest(command=f"call {call}", gpu="NVIDIA H200", gpus=1, root=tmp_path)
        m.update(name=name, commit="b3040c6e8818", tree_clean=True, date="2026-12-02")
        runs.write_manifest(src, m)
        (src / "rows.jsonl").write_text(json.dumps({"bench": "x", "call": call}) + "\n")
        archive = tmp_path / f"suite{call}.tar.gz"
        with tarfile.open(archive, "w:gz") as t:
            t.add(src, arcname=name)
        archives.append(archive)
    first = runs.unpack(archives[0], results)
    second = runs.unpack(archives[1], results)
    assert [p.name for p in first + second] == [name, f"{name}-2"]
    again = runs.read_run(results / f"{name}-2")
    assert again.manifest["command"] == "call 2" and again.name == f"{name}-2"
    assert json.loads((results / name / "rows.jsonl").read_text())["call"] == 1
    with pytest.raises(runs.ResultsError):
        runs.read_run(_renamed(results / name, results / f"{name}-1"))


def _renamed(src: Path, dest: Path) -> Path:
    """A copy of a run folder under another name (its manifest still says the old one)."""
    import shutil

    shutil.copytree(src, dest)
    return dest


def test_tree_state_refuses_a_short_stated_commit(tmp_path, monkeypatch):
    """A RELAYMOE_COMMIT of 7 digits once named a run folder ``..._unknown``: refused by name."""
    monkeypatch.setattr(runs, "git_state", lambda root: ("06a6893c75f0", False))
    for bad in ("67441ac", "67441AC793B5", "not-a-hash"):
        monkeypatch.setenv("RELAYMOE_COMMIT", bad)
        with pytest.raises(ValueError, match=f"RELAYMOE_COMMIT='{bad}'.*12 hex digits"):
            suite.tree_state(tmp_path)


def test_tree_state_prefers_the_stated_commit_over_a_stale_git(tmp_path, monkeypatch):
    """The device machine's git names the session's first commit under the tree it was sent."""
    monkeypatch.setattr(runs, "git_state", lambda root: ("06a6893c75f0", False))
    monkeypatch.setenv("RELAYMOE_COMMIT", "54c58a750d7f")
    monkeypatch.setenv("RELAYMOE_TREE_CLEAN", "1")
    commit, clean, source = suite.tree_state(tmp_path)
    assert (commit, clean) == ("54c58a750d7f", True) and "git there named 06a6893c75f0" in source
    monkeypatch.setenv("RELAYMOE_COMMIT", "06a6893c75f0")  # git agrees: git's word on the tree
    assert suite.tree_state(tmp_path)[:3] == ("06a6893c75f0", False, "git")
    monkeypatch.delenv("RELAYMOE_COMMIT")
    assert suite.tree_state(tmp_path)[:2] == ("06a6893c75f0", False)


def test_every_gpu_test_file_runs_in_some_step():
    """No GPU test file is left to ad hoc commands: each is an argument of a suite step (or a
    word of a group the e2e step runs)."""
    args = {w for s in suite.STEPS for a in (*s.args, *s.quick, *s.full) for w in a.split()}
    files = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "gpu").glob("test_*.py")
    )
    assert files and [f for f in files if f not in args] == []


def test_the_full_e2e_groups_hold_every_end_to_end_test_once():
    """--full runs test_e2e_gpu.py as concurrent groups of node ids: a test added to the file
    and to no group would never run, a test in two groups would run twice at once."""
    import ast

    from benchmarks.bench_e2e import FP8_FORMATS, FP8_RECIPES

    path = ROOT / "tests" / "gpu" / "test_e2e_gpu.py"
    names = [n.name for n in ast.parse(path.read_text()).body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]  # fmt: skip
    words = [w for g in suite.E2E_FULL_GROUPS for w in g.split()]
    ids = [w.split("::", 1)[1] for w in words if w.startswith("tests/gpu/test_e2e_gpu.py::")]
    fp8 = "test_fp8_recipe_trains_with_the_ring_where_alltoall_does"
    expected = sorted([n for n in names if n != fp8]
                      + [f"{fp8}[{f}-{r}]" for f in FP8_FORMATS for r in FP8_RECIPES])  # fmt: skip
    assert sorted(ids) == expected
    full = suite.plan(suite.STEPS, gpus=1, quick=False, out=ROOT, only=["gpu_tests_e2e"])
    assert full[0].command.count("--group") == len(suite.E2E_FULL_GROUPS)
