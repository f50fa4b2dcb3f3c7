"""Result runs: one folder per suite run, its ``manifest.json``, and ``CURRENT.json``.

Layout under ``benchmarks/results/``::

    <date>_<gpu>x<n>_<commit12>/   one suite run (or one hand-run device call), e.g.
                                   (a later run of the same commit and date: ``-2``, ``-3``)
        manifest.json              2026-11-30_h200x2_618066115fe2/
        *.jsonl                    benchmark rows (format: benchmarks/README.md)
        *.log, *.xml, *.png        whatever else the run left
    CURRENT.json                   {"runs": [<folder>, ...]}: the runs README.md and
                                   docs/RESULTS.md are generated from

A manifest (``MANIFEST_KEYS``) says what ran, where and from which tree: ``command``, ``commit``
(12 hex digits), ``tree_clean`` (true / false / "unknown"), ``gpu`` and ``gpus``, ``versions``
(python, torch, triton, megatron-core), ``date`` (YYYY-MM-DD) and ``order`` (seconds after
midnight UTC at which the run started: the newest run is the one with the largest
``(date, order)``), ``started`` (ISO time or "unknown"), and ``steps``: each step's ``name``,
``status`` (``STATUSES``), ``seconds``, the ``files`` it wrote and, where a step measured another
commit than the run's, that ``commit``. Anything not known is the string ``"unknown"``.

Only clean, committed measurements may reach the README: ``current_rows`` refuses a run whose
tree is not known to be clean and any row whose ``commit`` is unknown, ``-dirty``,
``-uncommitted`` or not the commit its manifest names for that file.

Pure Python (no torch): the README generator and the CI tests import it.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CURRENT = "CURRENT.json"
MANIFEST = "manifest.json"
UNKNOWN = "unknown"
STATUSES = ("ok", "failed", "timeout", "skipped", UNKNOWN)
VERSION_KEYS = ("python", "torch", "triton", "megatron-core")
MANIFEST_KEYS = (
    "name",
    "date",
    "order",
    "started",
    "command",
    "commit",
    "tree_clean",
    "gpu",
    "gpus",
    "versions",
    "steps",
)
# a second run of one commit on one date (several device calls) gets "-2", "-3", ... (unpack)
_NAME_RE = re.compile(
    r"^(\d{4}-\d{2}-\d{2})_([a-z0-9]+)x(\d+)_([0-9a-f]{12})(?:-[2-9]|-[1-9]\d+)?$"
)
_CLEAN_COMMIT_RE = re.compile(r"^[0-9a-f]{7,40}$")


class ResultsError(ValueError):
    """A run folder, manifest, CURRENT.json or row that the README may not be built from."""


def is_clean_commit(commit) -> bool:
    """A plain commit hash (7-40 hex digits): not ``unknown``, ``-dirty`` or ``-uncommitted``."""
    return isinstance(commit, str) and bool(_CLEAN_COMMIT_RE.match(commit))


def gpu_slug(gpu: str) -> str:
    """The folder name's GPU part: ``"NVIDIA H200"`` -> ``"h200"``, ``"cpu"`` -> ``"cpu"``."""
    words = [w for w in re.split(r"[^a-z0-9]+", str(gpu).lower()) if w]
    words = [w for w in words if w not in ("nvidia", "tesla", "geforce", "amd", "instinct")]
    if not words:
        raise ResultsError(f"gpu={gpu!r} names no device; pass e.g. 'NVIDIA H200' or 'cpu'")
    return words[0]


def run_name(date: str, gpu: str, gpus: int, commit: str) -> str:
    """``<date>_<gpu>x<n>_<commit12>``, e.g. ``2026-11-30_h200x2_618066115fe2``."""
    head = str(commit).split("-")[0]
    if not re.fullmatch(r"[0-9a-f]{12,40}", head):
        raise ResultsError(
            f"commit={commit!r}: a run folder is named by the 12-digit commit it measured; "
            "run from a git checkout (or set RELAYMOE_COMMIT to the full hash)"
        )
    if not isinstance(gpus, int) or gpus < 1:
        raise ResultsError(f"gpus={gpus!r} must be an integer >= 1")
    name = f"{date}_{gpu_slug(gpu)}x{gpus}_{head[:12]}"
    if not _NAME_RE.match(name):
        raise ResultsError(f"date={date!r} must be YYYY-MM-DD (got folder name {name!r})")
    return name


def git_state(root: Path = ROOT) -> tuple[str, bool | str]:
    """(12-digit HEAD commit, whether tracked files are unmodified) or ``unknown`` for either
    (a copy without ``.git``: the suite then takes the caller's ``RELAYMOE_COMMIT``). A copy
    inside another checkout (a ``git archive`` unpacked under the repository) is not that
    checkout: git would answer for the enclosing tree, so ``root`` must be the top level."""
    try:
        top = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        if Path(top).resolve() != Path(root).resolve():
            return UNKNOWN, UNKNOWN
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
        return UNKNOWN, UNKNOWN
    return head, not dirty


# Optional distributions a manifest names when present, None when absent (the GPU suite runs with
# TransformerEngine where it is installed and without it elsewhere: which one is in the rows).
OPTIONAL_VERSION_KEYS = ("transformer-engine",)


def versions() -> dict:
    """Installed versions of ``VERSION_KEYS`` (``"unknown"`` when missing) and of
    ``OPTIONAL_VERSION_KEYS`` (None when absent) from package metadata (imports nothing)."""
    import platform

    out = {"python": platform.python_version()}
    for dist in VERSION_KEYS[1:]:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = UNKNOWN
    for dist in OPTIONAL_VERSION_KEYS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def transformer_impl(vers: dict) -> str:
    """The ``--transformer-impl`` a run's Megatron jobs take by default (``benchmarks.e2e``):
    TransformerEngine where it is installed, else the local layers."""
    return "transformer_engine" if vers.get("transformer-engine") else "local"


def new_manifest(
    *, command: str, gpu: str, gpus: int, now: _dt.datetime | None = None, root: Path = ROOT
) -> dict:
    """A manifest for a run starting now, with no steps yet (append them as they finish)."""
    now = (now or _dt.datetime.now(_dt.UTC)).astimezone(_dt.UTC)
    commit, clean = git_state(root)
    date = now.date().isoformat()
    vers = versions()
    return {
        "name": run_name(date, gpu, gpus, commit) if commit != UNKNOWN else UNKNOWN,
        "date": date,
        "order": now.hour * 3600 + now.minute * 60 + now.second,
        "started": now.replace(microsecond=0).isoformat(),
        "command": command,
        "commit": commit,
        "tree_clean": clean,
        "gpu": gpu,
        "gpus": gpus,
        "versions": vers,
        # optional keys (older manifests lack them): the default layer implementation of the
        # run's Megatron jobs, and TE's version (None: not installed)
        "transformer_impl": transformer_impl(vers),
        "te_version": vers.get("transformer-engine"),
        "steps": [],
    }


def validate_manifest(m: dict, where: str) -> dict:
    """``m`` if it has every key with a sensible value; a ``ResultsError`` naming ``where`` and
    the key otherwise."""
    if not isinstance(m, dict):
        raise ResultsError(f"{where}: a manifest is a JSON object, got {type(m).__name__}")
    missing = [k for k in MANIFEST_KEYS if k not in m]
    if missing:
        raise ResultsError(
            f"{where}: missing keys {missing}; a manifest has {list(MANIFEST_KEYS)} "
            f"(write {UNKNOWN!r} for what is not known)"
        )
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(m["date"])):
        raise ResultsError(f"{where}: date={m['date']!r} must be YYYY-MM-DD")
    if not isinstance(m["order"], int) or not 0 <= m["order"] < 86400:
        raise ResultsError(
            f"{where}: order={m['order']!r} must be an integer in [0, 86400): the run's start "
            "in seconds after midnight UTC (it orders the runs of one date)"
        )
    if m["tree_clean"] not in (True, False, UNKNOWN):
        raise ResultsError(
            f"{where}: tree_clean={m['tree_clean']!r}; use true, false or {UNKNOWN!r}"
        )
    if not isinstance(m["versions"], dict):
        raise ResultsError(f"{where}: versions must map {list(VERSION_KEYS)} to version strings")
    if not isinstance(m["steps"], list):
        raise ResultsError(f"{where}: steps must be a list of {{name, status, seconds, files}}")
    for i, s in enumerate(m["steps"]):
        if not isinstance(s, dict) or not {"name", "status", "seconds", "files"} <= s.keys():
            raise ResultsError(f"{where}: steps[{i}] needs name, status, seconds and files")
        if s["status"] not in STATUSES:
            raise ResultsError(f"{where}: steps[{i}].status={s['status']!r}; one of {STATUSES}")
    return m


def write_manifest(folder: Path, m: dict) -> Path:
    path = Path(folder) / MANIFEST
    validate_manifest(m, str(path))
    path.write_text(json.dumps(m, indent=1) + "\n")
    return path


@dataclass(frozen=True)
class Run:
    """One result run folder and its manifest."""

    name: str
    path: Path
    manifest: dict

    @property
    def key(self) -> tuple[str, int]:
        """Newer runs sort later: (date, start in seconds after midnight)."""
        return (self.manifest["date"], self.manifest["order"])

    def file_commit(self, rel: str) -> str:
        """The commit the manifest says ``rel``'s rows measured: its step's, else the run's."""
        for s in self.manifest["steps"]:
            if rel in s.get("files", ()) and s.get("commit"):
                return s["commit"]
        return self.manifest["commit"]


def read_run(path: Path) -> Run:
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ResultsError(f"{path}: no {MANIFEST}; every run folder has one (benchmarks/runs.py)")
    try:
        m = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ResultsError(f"{mpath}: not JSON ({e})") from None
    validate_manifest(m, str(mpath))
    if m["name"] != path.name:
        raise ResultsError(f"{mpath}: name={m['name']!r} but the folder is {path.name!r}")
    if not _NAME_RE.match(path.name):
        raise ResultsError(
            f"{path}: a run folder is named <date>_<gpu>x<n>_<commit12> (benchmarks/runs.py)"
        )
    return Run(path.name, path, m)


def current_runs(results: Path = RESULTS) -> list[Run]:
    """The runs ``CURRENT.json`` lists, oldest first by ``(date, order)``."""
    results = Path(results)
    cpath = results / CURRENT
    if not cpath.is_file():
        raise ResultsError(f"{cpath} does not exist; it lists the run folders the README uses")
    try:
        names = json.loads(cpath.read_text()).get("runs")
    except (json.JSONDecodeError, AttributeError):
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ResultsError(f'{cpath}: expected {{"runs": ["<run folder>", ...]}}')
    runs = []
    for n in names:
        if not (results / n).is_dir():
            raise ResultsError(f"{cpath}: run {n!r} has no folder {results / n}")
        runs.append(read_run(results / n))
    by_key: dict = {}
    for r in runs:
        if r.key in by_key:
            raise ResultsError(
                f"{cpath}: runs {by_key[r.key]!r} and {r.name!r} have the same date and order "
                f"{r.key}: which is newer is undefined; correct one manifest's order"
            )
        by_key[r.key] = r.name
    return sorted(runs, key=lambda r: r.key)


@dataclass(frozen=True)
class Row:
    run: Run
    file: str  # path relative to the run folder
    line: int
    data: dict

    @property
    def source(self) -> str:
        """``benchmarks/results/<run>/<file>``."""
        return f"benchmarks/results/{self.run.name}/{self.file}"


def _check_clean(run: Run) -> None:
    m = run.manifest
    if m["tree_clean"] is not True or not is_clean_commit(m["commit"]):
        raise ResultsError(
            f"benchmarks/results/{run.name}/{MANIFEST}: commit={m['commit']!r}, "
            f"tree_clean={m['tree_clean']!r}; the README draws only from runs of a clean, "
            f"committed tree: remove {run.name!r} from {CURRENT} or rerun from a clean checkout"
        )


def _same_commit(a: str, b: str) -> bool:
    """Hashes abbreviated to different lengths name one commit when the shorter prefixes it."""
    n = min(len(a), len(b))
    return n >= 7 and a[:n] == b[:n]


def run_rows(run: Run, *, strict: bool = True) -> list[Row]:
    """Every row of ``run``'s ``.jsonl`` files (path order, then line order). ``strict``: the run
    and each row must be of a clean commit (``ResultsError`` naming the file and line)."""
    if strict:
        _check_clean(run)
    out = []
    for path in sorted(run.path.rglob("*.jsonl")):
        rel = path.relative_to(run.path).as_posix()
        want = run.file_commit(rel)
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"benchmarks/results/{run.name}/{rel}:{i}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ResultsError(f"{where}: not a JSON row ({e})") from None
            if not isinstance(row, dict):
                raise ResultsError(f"{where}: a row is a JSON object")
            c = row.get("commit", UNKNOWN)
            if strict and not is_clean_commit(c):
                raise ResultsError(
                    f"{where}: row commit {c!r} is unknown, dirty or uncommitted; a README "
                    f"number must come from a clean commit: remove {run.name!r} from {CURRENT} "
                    "or rerun the benchmark from a clean checkout"
                )
            if strict and not _same_commit(c, want):
                raise ResultsError(
                    f"{where}: row commit {c!r} is not the commit {want!r} its manifest names "
                    f"for {rel}; give that step its own 'commit' in the manifest, or fix the row"
                )
            out.append(Row(run, rel, i, row))
    return out


def current_rows(results: Path = RESULTS, *, strict: bool = True) -> list[Row]:
    """The rows of the ``CURRENT.json`` runs, oldest run first: a later row with the same
    identity is the newer measurement."""
    return [row for run in current_runs(results) for row in run_rows(run, strict=strict)]


def unpack(archive: Path, results: Path = RESULTS) -> list[Path]:
    """The run folders of a returned ``suite.tar.gz`` put under ``results``; a folder whose name
    is taken (a second device call at the same commit and date) becomes ``<name>-2`` (``-3``,
    ...), its manifest's ``name`` with it. Each folder must read back as a run."""
    import shutil
    import tarfile
    import tempfile

    results = Path(results)
    out = []
    with tempfile.TemporaryDirectory(dir=results) as tmp, tarfile.open(archive) as t:
        t.extractall(tmp, filter="data")
        for src in sorted(p for p in Path(tmp).iterdir() if p.is_dir()):
            run = read_run(src)
            name, n = run.name, 1
            while (results / name).exists():
                n += 1
                name = f"{run.name}-{n}"
            if name != run.name:
                m = dict(run.manifest, name=name)
                (src / MANIFEST).write_text(json.dumps(m, indent=1) + "\n")
            dest = results / name
            shutil.move(str(src), dest)
            out.append(read_run(dest).path)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.runs",
                                 description="result run folders")  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("unpack", help="put a returned suite.tar.gz's run folders in results/")
    u.add_argument("archives", nargs="+", type=Path)
    u.add_argument("--results", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    for archive in a.archives:
        for path in unpack(archive, a.results):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
