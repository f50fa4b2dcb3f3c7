"""Run several pytest selections at once on one GPU machine, each with its own log and JUnit file.

The GPU end-to-end tests are tiny Megatron runs whose time is the host's (launch, compile,
checkpoint I/O), not the GPU's: one H100 runs three of them side by side in about the time of
one. A device call is limited to ten minutes, so the file's tests run as concurrent groups::

    python3 -m benchmarks.pytest_groups --out DIR/e2e_ \
        --group "tests/gpu/test_e2e_gpu.py -k 200_steps" \
        --group "tests/gpu/test_e2e_gpu.py -k checkpoint"

Group N is ``python -m pytest -q -ra -p no:cacheprovider <group> --junitxml <out>N.xml``, its
output in ``<out>N.log`` (``--out`` is a path prefix: a suite step's files start with its
name). The exit status is the first failing group's (0 when all pass); a line per group is
printed as it ends. Timings printed by the tests under this sharing are not throughput figures.

Stopped with SIGTERM (the suite's step limit), the runner interrupts each group as Ctrl-C
would (SIGINT), so a test's Megatron job stops its own process group (``benchmarks.e2e``'s
runs do so on any interruption) instead of being left on the GPU for the next call; a group
still running ``STOP_GRACE_S`` later is killed, with whatever its tests started. Each group
runs in a session of its own, so that only the runner decides how it is stopped.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file (the suite's steps): make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.processes import descendants, kill_leftovers  # noqa: E402

STOP_GRACE_S = 12  # under the suite's 15 s between SIGTERM and SIGKILL


def _stop(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGINT to every running group; after ``grace_s`` SIGKILL to each group's session still
    alive and to any process the groups started that is left (``benchmarks.processes``)."""
    seen: dict[int, int] = {}
    for proc in procs:
        if proc.poll() is None:
            seen.update(descendants(proc.pid))
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            seen.update(descendants(proc.pid))
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    kill_leftovers(seen)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path prefix of the logs and JUnit files")
    p.add_argument("--group", action="append", required=True,
                   help="pytest arguments of one group (quoted; repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    jobs = []
    procs: list[subprocess.Popen] = []

    def on_term(signum, _frame):
        print(f"[group] signal {signum}: interrupting the running groups", flush=True)
        _stop(procs)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        for i, group in enumerate(args.group):
            log = Path(f"{args.out}{i}.log")
            cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                   *shlex.split(group), "--junitxml", f"{args.out}{i}.xml"]  # fmt: skip
            with log.open("w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=f, start_new_session=True))
            jobs.append((group, log, time.monotonic(), procs[-1]))
        status = 0
        left = dict(enumerate(jobs))
        while left:  # poll: each group's line as it ends, whichever ends first
            for i, (group, log, t0, proc) in list(left.items()):
                if proc.poll() is None:
                    continue
                del left[i]
                tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                print(f"[group {i}] rc={proc.returncode} {time.monotonic() - t0:.0f}s "
                      f"{group!r}: {tail[0]}", flush=True)  # fmt: skip
                status = status or proc.returncode
            time.sleep(0.5)
        return status
    except BaseException:  # Ctrl-C or an error here: no group outlives the runner
        _stop(procs)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
