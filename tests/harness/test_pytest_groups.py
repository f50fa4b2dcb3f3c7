"""benchmarks/pytest_groups.py on a CPU: groups run at once, each with its own log and JUnit
file, and the exit status is a failing group's."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from benchmarks import pytest_groups

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
