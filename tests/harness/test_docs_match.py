"""What the READMEs say about the suite, the examples and the flags is what they do (issue #52,
item 14): the suite's last line is the summary ``scripts/test.sh`` prints; every skip reason
a CPU run can show is listed; the ``xdist_group`` marker is registered (phase 2 runs without
xdist); every flag ``relaymoe.megatron.pretrain`` adds is documented; no example throws away
the flags ``relaymoe data`` prints after its header."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TEST_SH = (ROOT / "scripts" / "test.sh").read_text()


def test_the_suites_last_line_is_the_summary_the_readme_shows(tmp_path):
    """test.sh's ``summary`` (extracted and run on two phases' logs) gives the last line."""
    body = re.search(r"^summary\(\) \{.*?^\}$", TEST_SH, re.S | re.M).group(0)
    echo = re.search(r'^echo "\[relaymoe\] CPU suite: .*?"$', TEST_SH, re.S | re.M).group(0)
    (tmp_path / "1").write_text(
        "....s...\n12.30s call tests/lib/test_x.py::t\n"
        "1678 passed, 200 skipped, 5 warnings in 250.21s (0:04:10)\n"
    )
    (tmp_path / "2").write_text("=== 1 passed in 36.02s ===\n")
    script = f"LOGS={tmp_path}\n{body}\n{echo}\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    line = out.stdout.strip()
    assert line == (
        "[relaymoe] CPU suite: 1678 passed, 200 skipped, 5 warnings in 250.21s (0:04:10) (all "
        "but the 'alone' tests); 1 passed in 36.02s (the 'alone' tests, on their own)"
    ), line
    shown = " ".join(README.split())
    assert ("a last line summing up both: `[relaymoe] CPU suite: N passed, M skipped, ... in S s "
            "(all but the 'alone' tests); 1 passed in S s (the 'alone' tests, on their "
            "own)`") in shown  # fmt: skip


def test_phase_two_collects_the_alone_files_unless_an_argument_names_a_path():
    """With no path among test.sh's arguments, phase 2 hands pytest the files that mark tests
    ``alone`` (every such file, found here by reading them), not the whole tree; with one (a
    file, a FILE::TEST, a folder), the arguments alone decide, as in phase 1."""
    func = re.search(r"^names_a_path\(\) \{.*?^\}$", TEST_SH, re.S | re.M).group(0)
    block = re.search(r"^ALONE_FILES=\(\)$.*?^fi$", TEST_SH, re.S | re.M).group(0)
    assert re.search(r'-m alone "\$@" "\$\{ALONE_FILES\[@\]\}"', TEST_SH)
    script = f'set -euo pipefail\n{func}\n{block}\nprintf "%s\\n" "${{ALONE_FILES[@]}}"\n'

    def alone_files(*args: str) -> list[str]:
        p = subprocess.run(["bash", "-c", script, "test.sh", *args], capture_output=True,
                           text=True, check=True, cwd=ROOT)  # fmt: skip
        return [line for line in p.stdout.splitlines() if line]

    marked = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("*.py")
                    if re.search(r"\bmark\.alone\b", f.read_text()))  # fmt: skip
    assert "tests/harness/test_fault_harness.py" in marked, marked
    assert alone_files() == marked
    assert alone_files("-k", "routing", "-x") == marked
    for path in ("tests/lib/test_routing.py", "tests/lib/test_routing.py::test_x", "tests"):
        assert alone_files("-k", "x", path) == [], path


def test_every_gpu_or_te_skip_reason_is_listed_in_the_readme():
    reasons = set()
    for path in (ROOT / "tests").rglob("*.py"):
        reasons |= set(re.findall(r'reason="([^"]+)"', path.read_text()))
    hardware = r"^needs .*(GPU|CUDA|\bTE\b|TransformerEngine)|through TE$"
    wanted = {r.split(" (")[0] for r in reasons if re.search(hardware, r.split(" (")[0])}
    assert {"needs a GPU", "needs TE", "fp8 recipes run through TE"} <= wanted, wanted
    missing = sorted(r for r in wanted if f"`{r}`" not in README)
    assert not missing, f"README's skip reasons miss {missing}"


def test_the_xdist_group_marker_is_registered(tmp_path):
    """Phase 2 runs with ``-p no:xdist``, where pytest-xdist does not register its marker."""
    import sys

    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(m.split(":")[0].split("(")[0] == "xdist_group" for m in markers["markers"])
    (tmp_path / "test_marked.py").write_text(
        'import pytest\n\n@pytest.mark.xdist_group("g")\ndef test_x():\n    pass\n'
    )
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-c",
         str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-W",
         "error::pytest.PytestUnknownMarkWarning", str(tmp_path / "test_marked.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr


def test_every_flag_of_pretrain_is_documented():
    import argparse

    from relaymoe.megatron.pretrain import extra_args

    parser = extra_args(argparse.ArgumentParser())
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--relaymoe")]
    assert {"--relaymoe-report", "--relaymoe-weights-digest"} <= set(flags), flags
    missing = [f for f in flags if f"`{f}" not in README]
    assert not missing, f"README documents no {missing}"


def test_no_example_discards_the_flags_relaymoe_data_prints():
    """The tiny example sent them to /dev/null, leaving the header with nothing after it."""
    for script in (ROOT / "examples").rglob("*.sh"):
        calls = re.findall(r"-m relaymoe data\b(?:[^\n]*\\\n)*[^\n]*", script.read_text())
        for call in calls:
            assert ">/dev/null" not in call and "> /dev/null" not in call, (script, call)
