"""A stand-in ``python`` for the shell scripts under test (``PythonRelay``): each of the script's
Python calls runs through ``tests.worlds.run_python`` in the test's own process, forked from the
forkserver that has imported torch and Megatron, instead of in a fresh interpreter.

``examples/qwen3/train.sh`` runs ``python -m relaymoe.megatron.preflight`` before every launch
and dry run, and the preflight reads the command line with Megatron's parser: seconds of CPU
to import Megatron in each fresh interpreter, a fraction of a second in a forked one. What the
script does, the arguments, environment, working directory, output and exit status of each of
its calls are unchanged; what a fresh interpreter adds (its own imports, the warnings they
print) is not there, so a test of those runs the interpreter itself.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import socket
import subprocess
import sys
import tempfile
import time

from tests.worlds import run_python

# The stand-in: a Python without site or PYTHON* variables (it starts in milliseconds) that
# sends its arguments, environment and working directory and writes back what the call printed.
_CLIENT = """\
import json, os, socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.connect({socket!r})
    s.sendall(json.dumps({{"args": sys.argv[1:], "env": dict(os.environ),
                           "cwd": os.getcwd()}}).encode())
    s.shutdown(socket.SHUT_WR)
    reply = json.loads(b"".join(iter(lambda: s.recv(1 << 16), b"")))
sys.stdout.write(reply["stdout"])
sys.stderr.write(reply["stderr"])
sys.exit(reply["returncode"])
"""


class PythonRelay:
    """``python`` (an executable path) for a script that ``run`` runs: a call ``python ARGS``
    of the script runs ``python ARGS`` as ``run_python`` does (standard input empty) and passes
    on its stdout, stderr and exit status. Use as a context manager (``close`` removes it)."""

    def __init__(self):
        self._dir = tempfile.TemporaryDirectory(prefix="relay-")  # short: a socket path is
        self._socket = os.path.join(self._dir.name, "s")  # at most 107 bytes
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(self._socket)
        self._server.listen()
        self.python = os.path.join(self._dir.name, "python")
        with open(self.python, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I -S -c "
                    f"{shlex.quote(_CLIENT.format(socket=self._socket))} \"$@\"\n")  # fmt: skip
        os.chmod(self.python, 0o755)

    def run(self, args, *, env, cwd, timeout: float) -> subprocess.CompletedProcess:
        """``subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd,
        timeout=timeout)``, serving the calls of ``python`` meanwhile (one at a time, in this
        thread; each within what is left of ``timeout``)."""
        deadline = time.monotonic() + timeout
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            p = subprocess.Popen(args, stdout=out, stderr=err, text=True, env=env, cwd=cwd)
            try:
                while p.poll() is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise subprocess.TimeoutExpired(args, timeout)
                    if select.select([self._server], [], [], min(left, 0.05))[0]:
                        try:
                            self._serve(deadline)
                        except subprocess.TimeoutExpired:
                            raise subprocess.TimeoutExpired(args, timeout) from None
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(args, p.returncode, out.read(), err.read())

    def _serve(self, deadline: float) -> None:
        conn, _ = self._server.accept()
        with conn:
            call = json.loads(b"".join(iter(lambda: conn.recv(1 << 16), b"")))
            # past the deadline: TimeoutExpired (the call killed), for run to raise
            r = run_python(call["args"], env=call["env"], cwd=call["cwd"],
                           timeout=max(deadline - time.monotonic(), 0.1))  # fmt: skip
            code = r.returncode if r.returncode >= 0 else 128 - r.returncode  # a signal
            reply = {"returncode": code, "stdout": r.stdout, "stderr": r.stderr}
            conn.sendall(json.dumps(reply).encode())

    def close(self) -> None:
        self._server.close()
        self._dir.cleanup()

    def __enter__(self) -> PythonRelay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
