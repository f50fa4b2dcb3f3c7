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
printed when all have ended. Timings printed by the tests under this sharing are not
throughput figures.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path prefix of the logs and JUnit files")
    p.add_argument("--group", action="append", required=True,
                   help="pytest arguments of one group (quoted; repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    jobs = []
    for i, group in enumerate(args.group):
        log = Path(f"{args.out}{i}.log")
        cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
               *shlex.split(group), "--junitxml", f"{args.out}{i}.xml"]  # fmt: skip
        f = log.open("w")
        jobs.append((group, cmd, f, time.monotonic(), subprocess.Popen(cmd, stdout=f, stderr=f)))
    status = 0
    ended: dict[int, float] = {}
    while len(ended) < len(jobs):  # poll: each group's own time, whichever ends first
        for i, (*_, proc) in enumerate(jobs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(1.0)
    for i, (group, _cmd, f, t0, proc) in enumerate(jobs):
        f.close()
        tail = Path(f.name).read_text().strip().splitlines()[-1:] or ["(no output)"]
        print(f"[group] rc={proc.returncode} {ended[i] - t0:.0f}s {group!r}: {tail[0]}",
              flush=True)  # fmt: skip
        status = status or proc.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
