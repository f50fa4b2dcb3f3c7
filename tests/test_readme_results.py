"""The README "Results" section is generated from the committed JSON rows, byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "make_readme_results.py"
sys.path.insert(0, str(ROOT / "scripts"))
import make_readme_results as mrr  # noqa: E402

ROWS = {
    "2026-11-30/experts.jsonl": [
        {
            "bench": "experts",
            "provider": "naive",
            "shape": "qwen3_30b_a3b_T32k",
            "ms_fwd_bwd": 25.138,
            "tflops_fwd_bwd": 295.2,
            "peak_over_inputs_MiB": 4614.5,
            "gpu": "NVIDIA H200",
            "commit": "abc123",
            "command": "python3 bench_experts.py",
        },
        {
            "bench": "experts",
            "provider": "relaymoe",
            "shape": "qwen3_30b_a3b_T32k",
            "ms_fwd_bwd": 20.0,
            "tflops_fwd_bwd": 371.0,
            "peak_over_inputs_MiB": 3000.0,
            "gpu": "NVIDIA H200",
            "commit": "abc123",
            "command": "python3 bench_experts.py",
        },
    ],
    "2026-12-01/experts.jsonl": [  # a rerun: replaces the relaymoe row above
        {
            "bench": "experts",
            "provider": "relaymoe",
            "shape": "qwen3_30b_a3b_T32k",
            "ms_fwd_bwd": 15.5,
            "tflops_fwd_bwd": 478.9,
            "peak_over_inputs_MiB": 2900.0,
            "gpu": "NVIDIA H200",
            "commit": "def456",
            "command": "python3 bench_experts.py",
        },
    ],
    "2026-12-01/scaling_sim.jsonl": [
        {
            "bench": "scaling_sim",
            "kind": "validation",
            "scheme": "ring_expert",
            "shape": "qwen3_30b_a3b_T32k",
            "ep": 2,
            "measured_ms": 20.0,
            "predicted_ms": 21.0,
            "rel_err": 0.05,
            "fit": False,
        },
        {
            "bench": "scaling_sim",
            "kind": "extrapolation",
            "provider": "sim_ring_auto",
            "shape": "E128_K16",
            "ep": 64,
            "gpus_per_node": 8,
            "auto_mode": "expert",
            "ms_fwd_bwd": 163.6,
            "speedup_vs_alltoall": 3.66,
            "mem_reduction_vs_alltoall": 25.9,
        },
        {
            "bench": "scaling_sim",
            "kind": "extrapolation",
            "provider": "sim_alltoall",
            "shape": "E128_K16",
            "ep": 64,
            "gpus_per_node": 8,
            "ms_fwd_bwd": 599.4,
        },
    ],
}


@pytest.fixture
def tree(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    for rel, rows in ROWS.items():
        p = results / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Results\n{mrr.BEGIN}\nold\n{mrr.END}\n\n## After\n")
    return readme, results


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True
    )


def test_generate_then_check(tree):
    readme, results = tree
    assert mrr.main(["--readme", str(readme), "--results", str(results), "--check"]) == 1
    assert mrr.main(["--readme", str(readme), "--results", str(results)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n## Results\n") and text.endswith("\n\n## After\n")
    section = text.split(mrr.BEGIN)[1].split(mrr.END)[0]
    experts = section.split("### ")[1]
    assert "| 15.50 |" in experts and "| 20.00 |" not in experts  # the rerun wins
    assert "| 25.14 |" in experts  # naive kept from the first run
    assert "sim_alltoall" not in section and "| 3.66 |" in section
    assert "`def456`" in section and "NVIDIA H200" in section
    # idempotent and the CLI agrees
    assert mrr.main(["--readme", str(readme), "--results", str(results), "--check"]) == 0
    assert _run("--readme", readme, "--results", results, "--check").returncode == 0
    # a changed measurement makes the check fail
    with (results / "2026-12-01/experts.jsonl").open("a") as f:
        f.write(json.dumps({**ROWS["2026-12-01/experts.jsonl"][0], "ms_fwd_bwd": 14.0}) + "\n")
    r = _run("--readme", readme, "--results", results, "--check")
    assert r.returncode == 1 and "out of date" in r.stderr


def test_markers_required(tree):
    readme, results = tree
    readme.write_text("# no markers\n")
    assert mrr.main(["--readme", str(readme), "--results", str(results)]) == 2
    readme.write_text(f"{mrr.BEGIN}{mrr.BEGIN}{mrr.END}")
    assert mrr.main(["--readme", str(readme), "--results", str(results), "--check"]) == 2


def test_repository_readme_matches_committed_results():
    readme = ROOT / "README.md"
    if not readme.is_file() or mrr.BEGIN not in readme.read_text():
        pytest.skip("README.md has no results markers yet")
    r = _run("--check")
    assert r.returncode == 0, r.stdout + r.stderr
