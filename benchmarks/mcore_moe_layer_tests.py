"""megatron-core's own MoE layer unit tests with ``ring`` added to their dispatcher parameters.

    torchrun --nproc-per-node N benchmarks/mcore_moe_layer_tests.py --megatron-tests DIR \\
        [--ring-only] [--out summary.json] [-- PYTEST_ARGS...]

``DIR`` is a Megatron-LM checkout matching the installed megatron-core (tag ``core_v0.19.2``;
``core_v0.19.0`` has the same MoE, MLP, config and argument sources as the 0.19.2 wheel), or
just its test files: the runner needs ``tests/__init__.py``, ``tests/unit_tests/__init__.py``,
``tests/unit_tests/test_utilities.py``, ``tests/unit_tests/transformer/__init__.py``,
``tests/unit_tests/transformer/moe/__init__.py`` and
``tests/unit_tests/transformer/moe/test_moe_layer.py`` (about 22 kB; e.g.
``git -C Megatron-LM archive core_v0.19.0 <those paths> | tar -x -C .megatron_lm``). Nothing of
it is copied into this repository, and the test file is not edited: a pytest plugin defined
here appends ``"ring"`` to every ``@pytest.mark.parametrize("moe_token_dispatcher_type", ...)``
list that holds ``"alltoall"`` while pytest generates the items, after ``register()`` taught
megatron-core the ring. The tests build their layers from megatron-core's defaults: GELU experts
without gating and without bias, so the ring runs the expert MLP megatron-core ships.

The installed megatron-core is imported before ``DIR`` joins ``sys.path`` (a full checkout's
``megatron/`` would otherwise shadow it) and checked not to come from ``DIR``; conftest files
are not loaded (``--noconftest``: Megatron's download ``requests``/``click`` and data assets
for other tests; this file needs none of their fixtures), the plugin destroys the process group
at the end as theirs do.

Verdict: a ring item passes, or is refused by the ring's config check by name (reported as
skipped with the refusal: e.g. TP > 1 inherits expert tensor parallelism in these tests),
wherever its ``alltoall`` twin (same test, same other parameters) passes; ring items whose twin
fails too (e.g. a TP x EP larger than the world) are not held against the ring. The exit status
is 0 on that verdict, 1 otherwise; rank 0 prints the table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_FILE = "tests/unit_tests/transformer/moe/test_moe_layer.py"
NEEDED = ("tests/__init__.py", "tests/unit_tests/__init__.py", "tests/unit_tests/test_utilities.py",
          "tests/unit_tests/transformer/__init__.py",
          "tests/unit_tests/transformer/moe/__init__.py", TEST_FILE)  # fmt: skip
PARAM = "moe_token_dispatcher_type"
REFUSAL = "--moe-token-dispatcher-type ring cannot run"


def _argnames(spec) -> list[str]:
    if isinstance(spec, str):
        return [n.strip() for n in spec.split(",") if n.strip()]
    return list(spec)


def with_ring(argnames, values):
    """``values`` of a parametrize over ``argnames`` with ring rows added beside alltoall's, or
    None when it does not parametrize the dispatcher (or already has ring)."""
    names = _argnames(argnames)
    if PARAM not in names:
        return None
    at = names.index(PARAM)
    values = list(values)
    if len(names) == 1:
        flat = [getattr(v, "values", (v,))[0] for v in values]
        return None if "ring" in flat or "alltoall" not in flat else [*values, "ring"]
    rows = [tuple(getattr(v, "values", v)) for v in values]
    if any(r[at] == "ring" for r in rows):
        return None
    extra = [(*r[:at], "ring", *r[at + 1 :]) for r in rows if r[at] == "alltoall"]
    return [*values, *extra] if extra else None


class RingPlugin:
    """Adds ``ring`` to the dispatcher parametrizations, reports the ring's refusals as skips
    and records every item's outcome for :func:`verdict`."""

    def __init__(self, *, register: bool = True):
        self.register = register  # False: a test of the plugin itself, without Megatron
        self.results: dict[str, dict] = {}  # nodeid -> {test, params, outcome, why}

    def pytest_configure(self, config):
        if self.register:
            import relaymoe.megatron as rm

            rm.register()

    @pytest.hookimpl(tryfirst=True)  # before pytest's own hook turns the marks into items
    def pytest_generate_tests(self, metafunc):
        if PARAM not in metafunc.fixturenames:
            return
        for owner, mark in list(metafunc.definition.iter_markers_with_node("parametrize")):
            values = with_ring(mark.args[0], mark.args[1]) if len(mark.args) > 1 else None
            if values is None:
                continue
            new = pytest.mark.parametrize(mark.args[0], values, *mark.args[2:], **mark.kwargs)
            owner.own_markers[owner.own_markers.index(mark)] = new.mark

    def pytest_collection_finish(self, session):
        for item in session.items:  # what runs (after -k and the other deselections)
            params = dict(getattr(getattr(item, "callspec", None), "params", {}) or {})
            self.results[item.nodeid] = {
                "test": getattr(item, "originalname", item.name),
                "params": {k: repr(v) for k, v in params.items()},
                "outcome": "not run",
                "why": "",
            }

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """A ring item that raised the ring's refusal reads as skipped, with the refusal."""
        report = yield
        callspec = getattr(item, "callspec", None)
        ring = callspec is not None and callspec.params.get(PARAM) == "ring"
        exc = call.excinfo
        if ring and exc is not None and exc.errisinstance(ValueError) and REFUSAL in str(exc.value):
            problems = [ln.strip().lstrip("- ") for ln in str(exc.value).splitlines()[1:]]
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0,
                               "refused by the ring: " + "; ".join(problems))  # fmt: skip
        return report

    def pytest_runtest_logreport(self, report):
        rec = self.results.setdefault(report.nodeid, {"outcome": "not run", "why": ""})
        if rec["outcome"] in ("failed", "skipped"):
            return  # the first failure or skip of an item (setup, call, teardown) stands
        if report.failed:
            rec["outcome"], rec["why"] = "failed", _first_line(report.longreprtext)
        elif report.skipped:
            rec["outcome"], rec["why"] = "skipped", _skip_reason(report)
        elif report.when == "call":
            rec["outcome"] = "passed"

    def pytest_sessionfinish(self, session):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _first_line(text: str) -> str:
    """The first ``E`` line of a failure (the exception), else its last line."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("E "):
            return ln[2:].strip()[:300]
    return (lines[-1] if lines else "")[:300]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])[:300]
    return str(longrepr)[:300]


def verdict(results: dict[str, dict]) -> tuple[bool, list[dict]]:
    """``(ok, rows)``: one row per ring item with its alltoall twin's outcome; ok unless a ring
    item failed (or was skipped for another reason than a refusal) where its twin passed."""
    twins = {}
    for nodeid, rec in results.items():
        params = dict(rec.get("params", {}))
        dispatcher = params.pop(PARAM, None)
        key = (rec.get("test"), tuple(sorted(params.items())))
        twins.setdefault(key, {})[dispatcher] = (nodeid, rec)
    rows, ok = [], True
    for (test, params), by in sorted(twins.items(), key=lambda kv: str(kv[0])):
        if repr("ring") not in by:
            continue
        nodeid, rec = by[repr("ring")]
        twin = by.get(repr("alltoall"), (None, {"outcome": "absent"}))[1]["outcome"]
        refused = rec["outcome"] == "skipped" and rec["why"].startswith("refused by the ring")
        held = twin == "passed" and rec["outcome"] != "passed" and not refused
        ok = ok and not held
        rows.append({"test": test, "params": dict(params), "ring": "refused" if refused
                     else rec["outcome"], "alltoall": twin, "why": rec["why"],
                     "against_ring": held, "nodeid": nodeid})  # fmt: skip
    return ok, rows


def _prepare_path(tests_dir: Path) -> None:
    """The installed megatron-core first (imported before ``tests_dir`` joins the path), then
    ``tests_dir`` ahead of this checkout (whose own ``tests`` package would shadow Megatron's),
    this checkout's relaymoe ahead of any installed one."""
    import megatron.core  # noqa: F401  (the wheel, before a checkout's megatron/ is reachable)
    import megatron.training  # noqa: F401

    here = {str(ROOT), str(ROOT / "benchmarks"), ""}
    sys.path[:] = [str(tests_dir), str(ROOT)] + [p for p in sys.path if p not in here]
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        del sys.modules[name]  # relaymoe's own tests package, if anything imported it


def run_pytest(test_file: Path, rootdir: Path, extra=(), *, register: bool = True):
    """``(pytest's exit status, the RingPlugin with every item's outcome)`` of ``test_file``:
    no conftest, no ini file of this repository or Megatron's, no cache written into
    ``rootdir``."""
    plugin = RingPlugin(register=register)
    args = [str(test_file), "--noconftest", "-p", "no:cacheprovider", "-c", os.devnull,
            f"--rootdir={rootdir}", "-q", "-rs", *extra]  # fmt: skip
    return int(pytest.main(args, plugins=[plugin])), plugin


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--megatron-tests",
        required=True,
        type=Path,
        help="a Megatron-LM checkout (or its tests/ files listed above)",
    )
    p.add_argument(
        "--ring-only",
        action="store_true",
        help="run only the ring items (no alltoall twins: every ring item must pass "
        "or be refused by name)",
    )
    p.add_argument("--out", type=Path, help="write the summary rows here (JSON, rank 0)")
    p.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = p.parse_args(argv)  # fmt: skip
    tests_dir = args.megatron_tests.resolve()
    missing = [f for f in NEEDED if not (tests_dir / f).is_file()]
    if missing:
        p.error(f"--megatron-tests {tests_dir} lacks {missing}; give a Megatron-LM checkout "
                "(tag core_v0.19.2 or core_v0.19.0) or those files")  # fmt: skip
    _prepare_path(tests_dir)
    import megatron.core

    extra = [*args.pytest_args, *(["-k", "ring"] if args.ring_only else [])]
    rc, plugin = run_pytest(tests_dir / TEST_FILE, tests_dir, extra)
    where = Path(megatron.core.__file__).resolve()
    if tests_dir in where.parents:
        print(f"megatron-core came from {where}, inside --megatron-tests: not the installed one")
        return 1
    ok, rows = verdict(plugin.results)
    if args.ring_only:
        ok = all(r["ring"] in ("passed", "refused") for r in rows)
    ran = any(r["ring"] in ("passed", "refused") for r in rows)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"\nmegatron-core {megatron.core.__version__} ({where.parent}); pytest rc {rc}")
        for r in rows:
            mark = "AGAINST RING" if r["against_ring"] else ""
            print(f"  ring {r['ring']:8s} alltoall {r['alltoall']:8s} {r['test']} "
                  f"{r['params']} {mark} {r['why'][:160]}")  # fmt: skip
        print(
            f"verdict: {'ok' if ok else 'ring fails where alltoall passes'} "
            f"({len(rows)} ring items{'' if ran else ', none ran'})"
        )
        if args.out:
            args.out.write_text(json.dumps({"ok": ok, "pytest_rc": int(rc), "rows": rows,
                                            "megatron_core": megatron.core.__version__},
                                           indent=1))  # fmt: skip
    return 0 if ok and ran else 1


if __name__ == "__main__":
    sys.exit(main())
