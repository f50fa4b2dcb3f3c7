"""README.md's headline and docs/RESULTS.md are generated from the CURRENT result runs, byte for
byte; only clean, committed rows get in, and the newest run (by its manifest) wins."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import runs as rs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make_readme_results.py"
sys.path.insert(0, str(ROOT / "scripts"))
import make_readme_results as mrr  # noqa: E402

ENV = {"gpu": "NVIDIA H200", "command": "python3 bench_experts.py"}
OLD, NEW = "2026-12-01_h200x2_ffff00000000", "2026-12-01_h200x2_aaaa00000000"


def _expert(provider, ms, commit, shape="qwen3_30b_a3b_T32k"):
    return {"bench": "experts", "provider": provider, "shape": shape, "ms_fwd_bwd": ms,
            "peak_over_inputs_MiB": 3000.0, "commit": commit, **ENV}  # fmt: skip


def _ring(provider, ms, peak, commit):
    return {"bench": "ring", "provider": provider, "shape": "qwen3_30b_a3b_T32k", "ep": 2,
            "ms_fwd_bwd": ms, "peak_over_inputs_MiB": peak, "commit": commit, **ENV}  # fmt: skip


def _sim(kind, commit, **kw):
    return {"bench": "scaling_sim", "kind": kind, "commit": commit, "gpu": "cpu", **kw}


def _validation(commit, scheme, shape, measured_ms, predicted_ms, rel_err, fit):
    """A simulator validation row: the measured time of ``scheme`` at EP 2 and the prediction."""
    return _sim("validation", commit, scheme=scheme, shape=shape, ep=2, measured_ms=measured_ms,
                predicted_ms=predicted_ms, rel_err=rel_err, fit=fit)  # fmt: skip


# Path order puts OLD (ffff...) after NEW (aaaa...): only the manifests' order says which is newer.
RUNS = {
    OLD: (
        100,
        "ffff00000000",
        {
            "experts.jsonl": [
                _expert("naive", 25.138, "ffff00000000"),
                _expert("relaymoe", 20.0, "ffff00000000"),
            ],
            "ring.jsonl": [
                _ring("relaymoe_ring_auto", 24.0, 2000.0, "ffff00000000"),
                _ring("mcore_alltoall", 48.0, 8000.0, "ffff00000000"),
            ],
            "scaling_sim.jsonl": [
                _validation("ffff00000000", "ring_expert", "old_shape", 20.0, 21.0, 0.05, False),
            ],
        },
    ),
    NEW: (
        200,
        "aaaa00000000",
        {
            "experts.jsonl": [_expert("relaymoe", 15.5, "aaaa00000000")],  # the rerun wins
            "sim/scaling_sim.jsonl": [
                _validation("aaaa00000000", "ring_token", "new_shape", 10.0, 11.0, 0.1, True),
                _sim(
                    "extrapolation",
                    "aaaa00000000",
                    provider="sim_ring_auto",
                    shape="E128_K16",
                    ep=64,
                    gpus_per_node=8,
                    auto_mode="expert",
                    ms_fwd_bwd=163.6,
                    speedup_vs_alltoall=3.66,
                    mem_reduction_vs_alltoall=25.9,
                ),
                _sim(
                    "extrapolation",
                    "aaaa00000000",
                    provider="sim_alltoall",
                    shape="E128_K16",
                    ep=64,
                    gpus_per_node=8,
                    ms_fwd_bwd=599.4,
                ),
            ],  # fmt: skip
        },
    ),
}


def _manifest(name, order, commit, files, *, clean=True):
    return {
        "name": name, "date": name[:10], "order": order, "started": rs.UNKNOWN,
        "command": "bash scripts/gpu_suite.sh --quick", "commit": commit, "tree_clean": clean,
        "gpu": "NVIDIA H200", "gpus": 2,
        "versions": {k: rs.UNKNOWN for k in rs.VERSION_KEYS},
        "steps": [{"name": f.split("/")[-1].split(".")[0], "status": "ok", "seconds": 1,
                   "files": [f]} for f in files],
    }  # fmt: skip


def _write_run(results: Path, name, order, commit, files, *, clean=True):
    d = results / name
    for rel, rows in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rs.write_manifest(d, _manifest(name, order, commit, list(files), clean=clean))
    return d


@pytest.fixture
def tree(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    for name, (order, commit, files) in RUNS.items():
        _write_run(results, name, order, commit, copy.deepcopy(files))
    # not in CURRENT.json: its dirty row must not matter
    dirty = {"experts.jsonl": [_expert("relaymoe", 1.0, "bbbb00000000-dirty")]}
    _write_run(results, "2026-12-02_h200x2_bbbb00000000", 5, "bbbb00000000", dirty, clean=False)
    (results / rs.CURRENT).write_text(json.dumps({"runs": [NEW, OLD]}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Results\n{mrr.BEGIN}\nold\n{mrr.END}\n\n## After\n")
    doc = tmp_path / "RESULTS.md"
    doc.write_text(f"# Results\n{mrr.BEGIN}{mrr.END}\n")
    return readme, doc, results


def _args(tree, *extra):
    readme, doc, results = tree
    return ["--readme", str(readme), "--results-doc", str(doc), "--results", str(results), *extra]


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True
    )


def test_generate_then_check(tree):
    readme, doc, results = tree
    assert mrr.main(_args(tree, "--check")) == 1
    assert mrr.main(_args(tree)) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n## Results\n") and text.endswith("\n\n## After\n")
    head = text.split(mrr.BEGIN)[1].split(mrr.END)[0]
    assert "| MoE layer fwd+bwd, ms" in head and "| 24.00 | 48.00 | 0.50x |" in head
    assert "| 2,000 | 8,000 | 0.25x |" in head
    body = doc.read_text().split(mrr.BEGIN)[1].split(mrr.END)[0]
    experts = body.split("### ")[1]
    assert "| 15.50 |" in experts and "| 20.00 |" not in experts  # the newer run wins
    assert "| 25.14 |" in experts  # naive kept from the older run
    assert f"`benchmarks/results/{NEW}/experts.jsonl`" in experts
    assert "`aaaa00000000`" in experts and "NVIDIA H200" in experts
    # the simulation comes from the newest run that has simulation rows, and only from it
    assert "new_shape" in body and "old_shape" not in body
    assert "sim_alltoall" not in body and "| 3.66 |" in body
    # idempotent and the CLI agrees
    assert mrr.main(_args(tree, "--check")) == 0
    assert _run(*_args(tree, "--check")).returncode == 0
    # a changed measurement makes the check fail
    with (results / NEW / "experts.jsonl").open("a") as f:
        f.write(json.dumps(_expert("relaymoe", 14.0, "aaaa00000000")) + "\n")
    r = _run(*_args(tree, "--check"))
    assert r.returncode == 1 and "out of date" in r.stderr


def test_newest_run_is_the_manifests_not_the_paths(tree):
    _, doc, results = tree
    for name, order in ((OLD, 300), (NEW, 200)):  # now the ffff run is the newer one
        m = json.loads((results / name / rs.MANIFEST).read_text())
        rs.write_manifest(results / name, {**m, "order": order})
    assert mrr.main(_args(tree)) == 0
    experts = doc.read_text().split("### ")[1]
    assert "| 20.00 |" in experts and "| 15.50 |" not in experts
    # a later date beats any order
    m = json.loads((results / NEW / rs.MANIFEST).read_text())
    new_name = "2026-12-02_h200x2_aaaa00000000"
    (results / NEW).rename(results / new_name)
    rs.write_manifest(results / new_name, {**m, "name": new_name, "date": "2026-12-02"})
    (results / rs.CURRENT).write_text(json.dumps({"runs": [OLD, new_name]}))
    assert mrr.main(_args(tree)) == 0
    assert "| 15.50 |" in doc.read_text().split("### ")[1]


@pytest.mark.parametrize(
    "commit, why",
    [("unknown", "unknown, dirty"), ("aaaa00000000-dirty", "dirty"),
     ("0aa3b33-issue3-v3-uncommitted", "uncommitted"), ("cccc00000000", "not the commit")],
)  # fmt: skip
def test_refuses_unclean_rows_naming_file_and_row(tree, commit, why, capsys):
    _, _, results = tree
    with (results / NEW / "experts.jsonl").open("a") as f:
        f.write(json.dumps(_expert("liger", 30.0, commit)) + "\n")
    assert mrr.main(_args(tree)) == 2
    err = capsys.readouterr().err
    assert f"benchmarks/results/{NEW}/experts.jsonl:2" in err and why in err, err
    assert repr(commit) in err


def test_refuses_runs_that_are_not_known_clean(tree, capsys):
    _, _, results = tree
    m = json.loads((results / OLD / rs.MANIFEST).read_text())
    for clean, commit in ((False, "ffff00000000"), (rs.UNKNOWN, "ffff00000000"), (True, "unknown")):
        rs.write_manifest(results / OLD, {**m, "tree_clean": clean, "commit": commit})
        assert mrr.main(_args(tree)) == 2
        err = capsys.readouterr().err
        assert f"{OLD}/manifest.json" in err and "clean" in err, err


def test_a_step_may_name_its_own_commit(tree):
    _, doc, results = tree
    d = _write_run(results, "2026-12-01_h200x2_dddd00000000", 400, "dddd00000000",
                   {"baseline.jsonl": [_expert("liger", 31.0, "eeee00000000")]})  # fmt: skip
    (results / rs.CURRENT).write_text(json.dumps({"runs": [OLD, NEW, d.name]}))
    assert mrr.main(_args(tree)) == 2  # the row's commit is not the run's
    m = json.loads((d / rs.MANIFEST).read_text())
    m["steps"][0]["commit"] = "eeee00000000"
    rs.write_manifest(d, m)
    assert mrr.main(_args(tree)) == 0
    assert "`eeee00000000`" in doc.read_text()


def test_current_json_errors(tree, capsys):
    _, _, results = tree
    (results / rs.CURRENT).write_text(json.dumps({"runs": [OLD, "2026-12-09_h200x2_000000000000"]}))
    assert mrr.main(_args(tree)) == 2
    assert "has no folder" in capsys.readouterr().err
    m = json.loads((results / OLD / rs.MANIFEST).read_text())
    rs.write_manifest(results / OLD, {**m, "order": 200})  # the same (date, order) as NEW
    (results / rs.CURRENT).write_text(json.dumps({"runs": [OLD, NEW]}))
    assert mrr.main(_args(tree)) == 2
    assert "same date and order" in capsys.readouterr().err
    (results / rs.CURRENT).write_text("[]")
    assert mrr.main(_args(tree)) == 2
    assert '{"runs"' in capsys.readouterr().err


def test_markers_required(tree):
    readme, doc, _ = tree
    readme.write_text("# no markers\n")
    assert mrr.main(_args(tree)) == 2
    readme.write_text(f"{mrr.BEGIN}{mrr.BEGIN}{mrr.END}")
    assert mrr.main(_args(tree, "--check")) == 2


def test_max_seq_headline_pairs_whole_gpu_rows_of_one_run():
    def row(provider, seq, **kw):
        return {"bench": "max_seq", "provider": provider, "config": "c", "max_seq": seq,
                "commit": "abcdef1", **kw}  # fmt: skip

    old = [row("relaymoe_ring_fused_loss", 245760), row("mcore_alltoall", 65536)]
    new = [
        row("mcore_alltoall", 118784, first_oom_seq=122880, memory_cap_gpu=None),
        row("relaymoe_ring_fused_loss", 241664, bracket_open=True, memory_cap_gpu=None),
        row("mcore_alltoall", 28672, first_oom_seq=32768, memory_cap_gpu="64GB"),
        row("relaymoe_ring_fused_loss", 241664, memory_cap_gpu="64GB"),
    ]
    items = [("r1/max_seq.jsonl", r, "run") for r in old]
    items += [("r2/max_seq.jsonl", r, "run") for r in new[:2]]
    items += [("r2/max_seq_cap.jsonl", r, "run") for r in new[2:]]
    out = mrr.headline(items)
    # the newest uncapped alltoall row and the fused-loss rows of its run only
    assert "| >= 241,664 | 118,784 (out of memory at 122,880) | >= 2.03x |" in out
    assert "`r2/max_seq.jsonl`" in out and "r1/" not in out and "max_seq_cap" not in out
    # a converged fused-loss row is no lower bound
    items[-3] = ("r2/max_seq.jsonl", {**new[1], "bracket_open": False}, "run")
    assert "| 241,664 | 118,784 (out of memory at 122,880) | 2.03x |" in mrr.headline(items)
    # without a fused-loss row in the alltoall row's run: no max_seq line
    assert "Longest sequence" not in mrr.headline(items[:3])
    assert "without the fused loss" not in out  # no ring-alone row in that run


def test_max_seq_headline_says_how_much_of_the_gain_is_the_ring_s():
    """The same run's ring row without the fused loss goes into the line: equal to alltoall's,
    the line says the gain is the fused loss's; a ring row of another run is not used."""

    def row(provider, seq):
        return {"bench": "max_seq", "provider": provider, "config": "c", "max_seq": seq,
                "commit": "abcdef1", "memory_cap_gpu": None}  # fmt: skip

    items = [("r2/max_seq.jsonl", row(p, n), "run") for p, n in
             (("mcore_alltoall", 118784), ("relaymoe_ring_fused_loss", 241664),
              ("relaymoe_ring", 118784))]  # fmt: skip
    out = mrr.headline(items)
    assert "the ring without the fused loss: 118,784, the gain is the fused loss's" in out, out
    items[2] = ("r2/max_seq.jsonl", row("relaymoe_ring", 180000), "run")
    assert "the ring without the fused loss: 180,000, the ring alone 1.52x" in mrr.headline(items)
    items[2] = ("r1/max_seq.jsonl", row("relaymoe_ring", 180000), "run")
    assert "without the fused loss" not in mrr.headline(items)


def test_run_names_and_manifests(tmp_path):
    assert rs.gpu_slug("NVIDIA H200") == "h200" and rs.gpu_slug("cpu") == "cpu"
    name = rs.run_name("2026-11-30", "NVIDIA H100 80GB HBM3", 8, "0123456789abcdef")
    assert name == "2026-11-30_h100x8_0123456789ab"
    for bad in ("unknown", "0123456-dirty", "0123456"):
        with pytest.raises(rs.ResultsError, match="12-digit commit"):
            rs.run_name("2026-11-30", "NVIDIA H200", 2, bad)
    with pytest.raises(rs.ResultsError, match="missing keys"):
        rs.validate_manifest({"name": "x"}, "m.json")
    assert rs.is_clean_commit("618066115fe2") and not rs.is_clean_commit("618066115fe2-dirty")
    # outside a checkout: commit and cleanliness unknown; inside, both known
    m = rs.new_manifest(command="c", gpu="NVIDIA H200", gpus=2, root=tmp_path)
    assert m["commit"] == m["tree_clean"] == m["name"] == rs.UNKNOWN
    rs.validate_manifest(m, "new")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    m = rs.new_manifest(command="c", gpu="NVIDIA H200", gpus=2, root=tmp_path)
    assert m["tree_clean"] is True and re.fullmatch(
        r"2\d{3}-\d\d-\d\d_h200x2_[0-9a-f]{12}", m["name"]
    )
    (tmp_path / "f").write_text("2")
    assert rs.git_state(tmp_path)[1] is False
    # a copy unpacked inside the checkout (the device's git archive) is not that checkout
    (tmp_path / "copy").mkdir()
    assert rs.git_state(tmp_path / "copy") == (rs.UNKNOWN, rs.UNKNOWN)


def test_repository_results_match_the_current_runs():
    r = _run("--check")
    assert r.returncode == 0, r.stdout + r.stderr
    for doc in (ROOT / "README.md", ROOT / "docs" / "RESULTS.md"):
        section = doc.read_text().split(mrr.BEGIN)[1].split(mrr.END)[0]
        assert not re.search(r"unknown|dirty|uncommitted", section), doc


def test_repository_runs_have_valid_manifests():
    names = [p.name for p in rs.RESULTS.iterdir() if (p / rs.MANIFEST).is_file()]
    assert names, "no run folders"
    for n in names:
        rs.read_run(rs.RESULTS / n)
    assert {r.name for r in rs.current_runs()} <= set(names)


def test_e2e_headline_takes_the_anchors_faster_run():
    """The anchor at its best: the faster of its run and its same-seed repeat."""
    shape = "qwen3_slice_s4k_te"
    ring = {"bench": "e2e", "shape": shape, "provider": "relaymoe_ring", "tokens_per_s": 300.0}
    a2a = {"bench": "e2e", "shape": shape, "provider": "mcore_alltoall_te", "tokens_per_s": 100.0,
           "repeat_tokens_per_s": 150.0}  # fmt: skip
    out = mrr.headline([("r/e2e.jsonl", ring, "run"), ("r/e2e.jsonl", a2a, "run")])
    assert "| 300.0 | 150.0 | 2.00x |" in out
    a2a["repeat_tokens_per_s"] = None
    out = mrr.headline([("r/e2e.jsonl", ring, "run"), ("r/e2e.jsonl", a2a, "run")])
    assert "| 300.0 | 100.0 | 3.00x |" in out


def test_headline_rows_are_swiglu_rows():
    """A newer row of another expert activation (no competitor measured it) is not the headline."""
    base = {"bench": "experts", "shape": "qwen3_30b_a3b_T32k", "recompute": "act"}
    mine = {**base, "provider": "relaymoe", "ms_fwd_bwd": 15.0, "activation": "swiglu"}
    other = {**base, "provider": "relaymoe", "ms_fwd_bwd": 11.0, "activation": "gelu"}
    te = {**base, "provider": "te_grouped", "ms_fwd_bwd": 30.0}
    items = [("r/x.jsonl", r, "run") for r in (te, mine, other)]
    assert "| 15.00 | 30.00 | 0.50x |" in mrr.headline(items)


def test_headline_pairs_rows_of_one_run_and_of_bf16():
    """Each line's two rows come from one run folder (one machine start): a newer relaymoe row
    whose run lacks the baseline falls back to the newest run holding both. fp8 rows (their own
    table lines) never stand for the bf16 headline."""
    base = {"bench": "loss", "shape": "T64k"}
    old_ours = {**base, "provider": "relaymoe", "ms_fwd_bwd": 200.0}
    old_mcore = {**base, "provider": "megatron", "ms_fwd_bwd": 400.0}
    new_ours = {**base, "provider": "relaymoe", "ms_fwd_bwd": 100.0}
    items = [("old/loss.jsonl", old_ours, "old"), ("old/loss.jsonl", old_mcore, "old"),
             ("new/loss.jsonl", new_ours, "new")]  # fmt: skip
    out = mrr.headline(items)
    assert "| 200.0 | 400.0 | 0.50x |" in out and "old/loss.jsonl" in out
    assert "new/loss.jsonl" not in out
    new_mcore = {**base, "provider": "megatron", "ms_fwd_bwd": 300.0}
    both = [*items, ("new/loss.jsonl", new_mcore, "new")]
    assert "| 100.0 | 300.0 | 0.33x |" in mrr.headline(both)
    ex = {"bench": "experts", "shape": "qwen3_30b_a3b_T32k", "recompute": "act"}
    rows = [{**ex, "provider": "relaymoe", "ms_fwd_bwd": 15.0},
            {**ex, "provider": "te_grouped", "ms_fwd_bwd": 30.0},
            {**ex, "provider": "relaymoe", "ms_fwd_bwd": 9.0, "fp8": "blockwise"},
            {**ex, "provider": "te_grouped", "ms_fwd_bwd": 40.0, "fp8": "blockwise"}]  # fmt: skip
    assert "| 15.00 | 30.00 | 0.50x |" in mrr.headline([("r/x.jsonl", r, "r") for r in rows])
