"""benchmarks/lab/relay_host_cost.py runs on CPU and writes its row."""


def test_relay_host_cost_harness_runs():
    """benchmarks/lab/relay_host_cost.py (the ring machinery's own host time per hop) in a child
    process (it initialises a process group of one)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "lab" / "relay_host_cost.py"), "--world", "4",
         "--passes", "3", "--repeats", "2"],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert row["bench"] == "relay_host" and row["hops"] == 5 and row["us_per_hop"] > 0
    assert 0 < row["us_per_hop_min"] <= row["us_per_hop"] and row["repeats"] == 2
    assert row["us_per_hop_cpu"] > 0
