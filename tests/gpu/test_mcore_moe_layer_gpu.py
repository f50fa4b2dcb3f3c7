"""GPU: megatron-core 0.19's own ``test_moe_layer.py`` with ``ring`` beside its dispatchers.

``benchmarks/mcore_moe_layer_tests.py`` runs the Megatron-LM file unedited under torchrun on
every GPU (up to 8, the world its TP x EP cases ask for) and appends ``ring`` to each dispatcher
parametrization; every ring item must pass, or be refused by the ring's config check by name,
wherever its alltoall twin passes. The tests build megatron-core's default experts (GELU, not
gated, no bias), so this is also the ring running an expert MLP other than SwiGLU inside
Megatron's own tests.

Needs Megatron-LM's test files, never committed here: ``MEGATRON_LM_DIR`` (a checkout, tag
``core_v0.19.2`` or ``core_v0.19.0``) or ``.megatron_lm/`` in this checkout holding at least the
six files ``benchmarks/mcore_moe_layer_tests.py`` lists (about 22 kB), and TransformerEngine
(half the file builds TE layers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _megatron_tests() -> Path | None:
    from benchmarks.mcore_moe_layer_tests import NEEDED

    for where in (os.environ.get("MEGATRON_LM_DIR"), ROOT / ".megatron_lm"):
        if where and all((Path(where) / f).is_file() for f in NEEDED):
            return Path(where)
    return None


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not have_te(), reason="needs TransformerEngine"),
    pytest.mark.skipif(_megatron_tests() is None,
                       reason="set MEGATRON_LM_DIR (or .megatron_lm/) to Megatron-LM's tests"),
]  # fmt: skip


def test_megatron_moe_layer_tests_with_ring(tmp_path):
    gpus = min(torch.cuda.device_count(), 8)
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
           str(ROOT / "benchmarks" / "mcore_moe_layer_tests.py"), "--megatron-tests",
           str(_megatron_tests()), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    tail = (p.stdout + p.stderr)[-6000:]
    assert out.is_file(), f"rc={p.returncode}\n{tail}"
    summary = json.loads(out.read_text())
    against = [r for r in summary["rows"] if r["against_ring"]]
    assert summary["ok"] and not against, json.dumps(against, indent=1) + "\n" + tail
    ran = [r for r in summary["rows"] if r["ring"] == "passed"]
    assert ran, f"no ring item passed\n{tail}"
    print(f"{len(ran)} ring items passed, "
          f"{sum(r['ring'] == 'refused' for r in summary['rows'])} refused by name")  # fmt: skip
