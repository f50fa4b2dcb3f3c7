"""A commit's library and benchmarks in ``.baseline/`` (git-ignored), to time an old tree and
this one in one device call: a before/after within one machine start, as the 3% checks need.

    python benchmarks/lab/baseline_tree.py 9a6fd15 [--dest .baseline]

then carry ``.baseline`` and run its scripts as the tree's, e.g. ``--step hop_base='.baseline/
benchmarks/hop_cost.py --library --ep 2 --tokens 4096 --out {out}/hop_base.jsonl'``.

Its ``hop_cost.py`` (where it has one) gets this tree's ``gpu_us_per_pass_by_kernel`` row field
(``benchmarks/lab/hop_cost.py: kernel_times``: a pure function of the profiler's device events,
the same in both trees), so that a hop that got slower can be told apart kernel by kernel.
Rows the old scripts write carry the suite's commit: rename their files and fix their
``commit`` fields before publishing (the lab notes say how it was done)."""

from __future__ import annotations

import argparse
import inspect
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ANCHOR = '"hops_profiled": len(hop_ranges),'
MAIN_GUARD = 'if __name__ == "__main__":'


def with_kernel_times(source: str) -> str:
    """``hop_cost.py``'s ``source`` with the per-kernel field added to its pass rows (and the
    function that makes it, defined before the script's ``if __name__ == "__main__":``, which
    runs it), or ``source`` itself when it has it already; ValueError when its pass row is not
    recognised."""
    from benchmarks.lab import hop_cost

    if "gpu_us_per_pass_by_kernel" in source:
        return source
    if source.count(ANCHOR) != 1 or "\n    dev = [" not in source:
        raise ValueError("hop_cost.py: no single pass row (`" + ANCHOR + "`) to add the field to")
    field = ANCHOR + '\n        "gpu_us_per_pass_by_kernel": kernel_times(dev, n),'
    source = source.replace(ANCHOR, field)
    function = inspect.getsource(hop_cost.kernel_times) + "\n\n"
    head, guard, tail = source.partition(MAIN_GUARD)
    if not guard:
        return source + "\n\n" + function
    return head + function + guard + tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commit")
    ap.add_argument("--dest", default=str(ROOT / ".baseline"))
    a = ap.parse_args(argv)
    dest = Path(a.dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", a.commit, "relaymoe", "benchmarks"],
                         capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "x", "-C", str(dest)], input=tar, check=True)
    shutil.rmtree(dest / "benchmarks" / "results", ignore_errors=True)
    for path in (dest / "benchmarks" / "hop_cost.py", dest / "benchmarks" / "lab" / "hop_cost.py"):
        if path.exists():
            path.write_text(with_kernel_times(path.read_text()))
    print(f"{a.commit} -> {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
