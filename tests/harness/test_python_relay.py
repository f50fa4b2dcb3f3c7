"""tests/python_relay.py, the stand-in ``python`` of the shell scripts under test: each call of
the script runs in a process forked from the forkserver (torch already imported) with the
call's arguments, environment and working directory, and its stdout, stderr and exit status
come back to the script as a fresh interpreter's would; the script's own output, status and
timeout are ``subprocess.run``'s."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.python_relay import PythonRelay

# stdout captured by the script, stderr to a file it then prints, the exit status it then reads
_SCRIPT = """\
set -e
OUT="$("$PY" -c 'import os, sys
print(sys.argv[1:], os.getcwd(), os.environ["RELAYED"])
print("to stderr", file=sys.stderr)' "a b" c 2>"$PWD/err")"
echo "got $OUT"
cat err >&2
"$PY" -c 'import sys; sys.exit(3 if "torch" in sys.modules else 2)' || echo "status $?"
exit 5
"""


def test_a_scripts_python_calls_come_back_as_a_fresh_interpreters(tmp_path):
    script = tmp_path / "s.sh"
    script.write_text(_SCRIPT)
    (tmp_path / "cwd").mkdir()
    with PythonRelay() as relay:
        env = dict(os.environ, PY=relay.python, RELAYED="yes")
        r = relay.run(["bash", str(script)], env=env, cwd=tmp_path / "cwd", timeout=120)
        assert r.returncode == 5, (r.stdout, r.stderr)
        assert f"got ['a b', 'c'] {tmp_path / 'cwd'} yes\n" in r.stdout, r.stdout
        assert r.stderr == "to stderr\n"
        assert "status 3\n" in r.stdout  # forked from the forkserver: torch was imported there
        start = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            relay.run(["bash", "-c", '"$PY" -c "import time; time.sleep(60)"'], env=env,
                      cwd=tmp_path, timeout=2)  # fmt: skip
        assert time.monotonic() - start < 30
