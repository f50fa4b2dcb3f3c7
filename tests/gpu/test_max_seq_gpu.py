"""GPU: ``benchmarks/max_seq.py``'s trials as they run for issue #53, on the tiny Qwen3 at EP 1
under TransformerEngine (run by the suite's ``gpu_tests_megatron`` step).

* Megatron trains each TE provider's exact trial flags under the policy it would be searched
  with: megatron-core's selective set (``moe_act layernorm core_attn moe``) with TE and the
  alltoall dispatcher and megatron-core's fused cross-entropy; the ring's recompute plan;
* rank 0's report carries each step's memory phases (``--relaymoe-memory-phases``): every mark
  taken, in order, the running maximum at the step's end equal to the report's own peak, the
  terms summing to that peak;
* without recompute the layers keep more than under full recompute, as the planner says.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import max_seq as ms
from relaymoe.megatron.memory_phases import MARKS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not ms.have_te(), reason="the TE providers need TransformerEngine"),
]

CONFIG, SEQ = "tiny_qwen3", 512  # the config's longest position


def run_trial(provider: str, policy: str, tmp_path) -> tuple[ms.Trial, dict]:
    gpu = torch.cuda.get_device_properties(0).total_memory
    flags = ms.trial_flags(CONFIG, provider, SEQ, gpus=1, policy=policy, gpu_bytes=gpu)
    r = ms.launch(flags, gpus=1, timeout_s=240, workdir=tmp_path / f"{provider}_{policy}")
    t = ms.trial_from_log(
        SEQ, returncode=r["returncode"], timed_out=r["timed_out"], timeout_s=240,
        wall_s=r["wall_s"], steps=r["steps"], log=r["log"], expected_steps=ms.STEPS,
        marker=ms.trial_markers(provider, capped=False), log_dir=r["log_dir"],
    )  # fmt: skip
    assert t.ok, f"{provider}/{policy}: {t.reason}: {t.detail}\n{r['command']}"
    return t, r


def check_phases(steps: list[dict]) -> None:
    for step in steps:
        m = step["memory_phases"]
        assert "error" not in m, m
        running = [m["marks"][k][1] for k in MARKS]
        assert running == sorted(running), m["marks"]  # the running maximum only grows
        assert m["peak_bytes"] == pytest.approx(step["peak_MiB"] * 2**20, abs=2**20)
        assert sum(v for v in m["terms"].values() if v) == m["peak_bytes"]
        assert m["terms"]["model_states"] > 0 and m["binding_term"] is not None


@pytest.mark.parametrize("provider", ["mcore_alltoall_te", "relaymoe_ring_te"])
def test_the_selective_policy_trains_and_reports_its_memory_phases(provider, tmp_path):
    t, r = run_trial(provider, "selective", tmp_path)
    check_phases(r["steps"])
    assert t.memory == r["steps"][-1]["memory_phases"] and t.tokens_per_s > 0
    if provider == "mcore_alltoall_te":
        assert "--cross-entropy-loss-fusion" in r["command"]
        assert "--recompute-modules moe_act layernorm core_attn moe" in r["command"]


def test_no_recompute_keeps_more_than_full_recompute(tmp_path):
    kept = {}
    for policy in ("full", "none"):
        t, r = run_trial("relaymoe_ring_te_fused_loss", policy, tmp_path)
        check_phases(r["steps"])
        m = r["steps"][-1]["memory_phases"]
        if m["terms"]["activations_retained"] is not None:
            kept[policy] = m["terms"]["activations_retained"]
        else:  # the peak fell in the optimizer: what the layers hold at the loss's start
            kept[policy] = m["marks"]["loss_start"][0] - m["marks"]["forward_start"][0]
    assert kept["none"] > kept["full"] > 0, kept
