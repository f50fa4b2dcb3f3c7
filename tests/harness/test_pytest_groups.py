"""benchmarks/pytest_groups.py on a CPU: groups run at once, each with its own log and JUnit
file, and the exit status is a failing group's."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from benchmarks import pytest_groups

ROOT = Path(__file__).resolve().parents[2]

# Two tests that meet: each marks its start and waits for the other's mark, so they pass only
# when their groups run at the same time (one after the other, the first gives up and fails).
_MEET = """
import pathlib, time
def meet(me, other):
    here = pathlib.Path(__file__).parent
    (here / me).touch()
    for _ in range(600):
        if (here / other).exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"{other} never started beside {me}")
def test_a():
    meet("a.started", "b.started")
def test_b():
    meet("b.started", "a.started")
def test_broken():
    assert 1 == 2
"""


def test_groups_run_side_by_side_and_a_failing_group_fails_the_run(tmp_path):
    tests = tmp_path / "test_fake.py"
    tests.write_text(_MEET)
    prefix = f"{tmp_path}/run_"
    groups = [a for t in ("test_a", "test_b", "test_broken") for a in ("--group", f"{tests}::{t}")]
    rc = pytest_groups.main(["--out", prefix, *groups])
    assert rc == 1  # pytest's status for a failed test, from the third group
    suites = [s for i in range(3) for s in ET.parse(f"{prefix}{i}.xml").getroot().iter("testsuite")]
    assert [(int(s.get("tests")), int(s.get("failures"))) for s in suites] == [
        (1, 0),
        (1, 0),
        (1, 1),
    ]
    assert "1 passed" in (tmp_path / "run_0.log").read_text()
    assert "assert 1 == 2" in (tmp_path / "run_2.log").read_text()


# A test that starts a long job in a session of its own, as benchmarks.e2e's Megatron runs do,
# and stops the job's group on any interruption.
_JOB = """
import os, pathlib, signal, subprocess, sys
def test_job():
    here = pathlib.Path(__file__).parent
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                           start_new_session=True)
    try:  # the pid is announced inside: an interruption as soon as it is seen still stops it
        (here / "job.pid").write_text(str(job.pid))
        job.wait()
    except BaseException:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait()
        (here / "job.stopped").touch()
        raise
"""


def test_a_stopped_runner_interrupts_its_groups_and_their_jobs_stop(tmp_path):
    """The suite stops a step past its limit with SIGTERM to the step's process group: the
    runner interrupts each group, whose test stops the job it started, so nothing of the step
    is left running."""
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "test_job.py").write_text(_JOB)
    runner = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.pytest_groups", "--out", f"{tmp_path}/run_",
         "--group", f"{tmp_path / 'test_job.py'}"],
        cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    pid_file = tmp_path / "job.pid"
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        assert runner.poll() is None, runner.communicate()[0]
        time.sleep(0.1)
    job = int(pid_file.read_text())
    try:
        os.killpg(runner.pid, signal.SIGTERM)
        out, _ = runner.communicate(timeout=60)
        assert runner.returncode == 128 + signal.SIGTERM, out
        assert "interrupting the running groups" in out
        assert (tmp_path / "job.stopped").exists(), (tmp_path / "run_0.log").read_text()
        with pytest.raises(ProcessLookupError):
            os.kill(job, 0)
    finally:  # a failing check leaves nothing running
        for pid in (job, runner.pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_group_that_ignores_the_interrupt_is_killed_with_what_it_started(tmp_path):
    """Past the grace, the group's session and the processes it started in sessions of their
    own (a Megatron job a test left running) are killed."""
    import os
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "job.pid"
    group = subprocess.Popen(
        [sys.executable, "-c",
         "import pathlib, signal, subprocess, sys, time\n"
         "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
         "job = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
         "                       start_new_session=True)\n"
         f"pathlib.Path({str(pid_file)!r}).write_text(str(job.pid))\n"
         "time.sleep(600)\n"],
        start_new_session=True,
    )  # fmt: skip
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    job = int(pid_file.read_text())
    try:
        pytest_groups._stop([group], grace_s=1.0)
        assert group.wait(timeout=30) == -signal.SIGKILL
        for _ in range(100):
            try:
                os.kill(job, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        with pytest.raises(ProcessLookupError):
            os.kill(job, 0)
    finally:
        for pid in (job, group.pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
