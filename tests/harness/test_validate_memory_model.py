"""CPU parts of benchmarks/validate_memory_model.py: the case list, the planner configs built
from it, Megatron's recompute semantics, the result rows, the CLI without a GPU, and two checks
against megatron-core itself on the CPU: the planner's parameter count equals the built model's,
and the alltoall expert term (what megatron's experts keep for backward) equals the planner's."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch

from benchmarks import validate_memory_model as vmm
from relaymoe.planner import memory as mm
from relaymoe.planner.recompute import stage_peak
from tests.fixtures import SMALL_MODEL

MiB = 2**20

TINY = vmm.Case(
    "tiny",
    64,
    2,
    dispatcher="allgather",  # megatron's alltoall dispatcher needs CUDA streams at build time
    model={**SMALL_MODEL, "ffn_hidden_size": 128, "vocab_size": 256},
)


# ----------------------------------------------------------------------------- the case list
def test_cases_cover_the_required_variety():
    names = [c.name for c in vmm.CASES]
    assert len(names) == len(set(names))
    quick = [c for c in vmm.CASES if c.quick]
    assert len(quick) >= 6
    for cases in (vmm.CASES, quick):
        assert {c.dispatcher for c in cases} >= {"alltoall", "ring"}
        assert len({c.seq for c in cases}) >= 2 and len({c.mbs for c in cases}) >= 2
        assert len({c.num_layers for c in cases}) >= 2
        assert (
            len({(c.model_dict["num_experts"], c.model_dict["moe_router_topk"]) for c in cases})
            >= 2
        )
        assert {c.recompute for c in cases} >= {None, "full_uniform"}
    for c in vmm.CASES:
        cfg = vmm.planner_config(c)  # validates (raises on a bad layout)
        p = cfg.parallel
        assert (p.tp, p.cp, p.pp, p.ep, p.dp, p.world_size) == (1, 1, 1, 1, 1, 1)
        assert cfg.training.seq_length == c.seq and cfg.training.micro_batch_size == c.mbs
        assert cfg.model.num_experts == c.model_dict["num_experts"]


def test_kept_layers_follow_megatron_recompute():
    c4 = dataclasses.replace(TINY, model={**TINY.model, "num_layers": 4})
    assert c4.kept_layers() == frozenset(range(4))
    assert c4.recompute_settings() == (None, None, None)
    u = dataclasses.replace(c4, recompute="full_uniform")
    assert u.kept_layers() == frozenset() and u.recompute_settings() == ("full", "uniform", 1)
    b = dataclasses.replace(c4, recompute="full_block:3")
    assert b.kept_layers() == frozenset({3}) and b.recompute_settings() == ("full", "block", 3)
    cfg = vmm.planner_config(b)
    assert (cfg.training.recompute_method, cfg.training.recompute_num_layers) == ("block", 3)
    with pytest.raises(ValueError, match="full_block:5"):
        dataclasses.replace(c4, recompute="full_block:5").kept_layers()
    with pytest.raises(ValueError, match="selective"):
        dataclasses.replace(c4, recompute="selective").recompute_settings()


def test_prediction_is_the_planners_stage_peak():
    for c in (TINY, dataclasses.replace(TINY, recompute="full_uniform"), vmm.CASES[1]):
        p = vmm.predict(c)
        cfg = vmm.planner_config(c)
        disp = "ring" if c.dispatcher == "ring" else "alltoall"
        pk = stage_peak(cfg, 0, disp, c.kept_layers(), ring_mode="expert")
        assert p["total"] == pk.total
        assert p["states"] == pk.terms["params"] + pk.terms["grads"] + pk.terms["optimizer"]
        assert p["states"] + p["activations"] == p["total"]
        assert p["params"] == mm.total_params(cfg)
    # recomputing every layer keeps only layer inputs: less retained than keeping them all
    kept = vmm.predict(TINY)["terms"]["activations_retained"]
    rec = vmm.predict(dataclasses.replace(TINY, recompute="full_uniform"))
    assert rec["terms"]["activations_retained"] < kept
    sh = mm.shapes(vmm.planner_config(TINY))
    assert rec["terms"]["activations_retained"] == 2 * mm.layer_input_bytes(sh)


def test_planner_norm_impl_follows_the_local_spec(monkeypatch):
    import importlib.util

    # this machine has no apex: megatron-core's local spec builds WrappedTorchNorm
    have = importlib.util.find_spec("apex") is not None
    from benchmarks.common import torch_norm_impl

    assert vmm.local_spec_norm_impl() == ("fused" if have else torch_norm_impl())
    assert vmm.planner_config(TINY).training.normalization_impl == vmm.local_spec_norm_impl()
    assert vmm.planner_config(TINY, "fused").training.normalization_impl == "fused"
    # the composite torch fallback's extra, hand-computed: T = 128 tokens, h = 64, q/k norms
    # over (4 + 2) heads * 16, 8 bytes per element; 2 kept layers and the final norm
    t, f = vmm.predict(TINY, "torch_composite"), vmm.predict(TINY, "fused")
    per_layer = 2 * 128 * 64 + 128 * 6 * 16
    assert t["total"] - f["total"] == 8 * (2 * per_layer + 128 * 64)
    assert t["layer"]["norm_extra"] == 8 * per_layer and f["layer"]["norm_extra"] == 0
    assert t["normalization_impl"] == "torch_composite"
    # torch's fused RMSNorm kernel keeps what the fused norms keep
    assert vmm.predict(TINY, "torch")["total"] == f["total"]


# ------------------------------------------------------------------------------------ rows
def _measured(peak, states):
    return {"peak": peak, "states": states, "fwd_retained": 3 * MiB, "fwd_bwd_peak": peak,
            "optim_peak": states + MiB, "peak_phase": "fwd_bwd", "layers": [
                {"layer": 0, "retained": 2 * MiB, "attn_part": MiB, "mlp_part": MiB}]}  # fmt: skip


def test_compare_row_errors_and_keys():
    pred = vmm.predict(TINY)
    row = vmm.compare(TINY, _measured(pred["total"], pred["states"]), pred)
    assert row["bench"] == "memory_model" and row["config"] == "tiny"
    assert row["rel_err"] == 0 and row["within_10pct"] and row["rel_err_states"] == 0
    assert row["dispatcher"] == "allgather" and "alltoall formula" in row["model_note"]
    assert row["layer_retained_MiB"] == [2.0]
    assert row["norm_impl_planner"] == pred["normalization_impl"]
    fused = vmm.predict(TINY, "fused")["total"]
    assert row["predicted_fused_norm_MiB"] == round(fused / MiB, 1)
    if pred["normalization_impl"] == "torch_composite":
        assert row["predicted_fused_norm_MiB"] < row["predicted_MiB"]
        assert row["rel_err_fused_norm"] < 0
    json.dumps(row)  # a JSON row
    # measured 25% above the prediction: rel_err -0.2, outside the 10% bar
    low = vmm.compare(TINY, _measured(pred["total"] * 1.25, pred["states"]), pred)
    assert low["rel_err"] == pytest.approx(-0.2, abs=1e-4) and not low["within_10pct"]
    # the activation part alone: predicted activations / measured (peak - states) - 1
    m = _measured(pred["states"] + 2 * pred["activations"], pred["states"])
    assert vmm.compare(TINY, m, pred)["rel_err_act"] == pytest.approx(-0.5, abs=1e-4)
    ring = vmm.CASES[1]
    assert "model_note" not in vmm.compare(ring, _measured(MiB, MiB // 2), vmm.predict(ring))


def test_cli_plan_only_and_no_gpu(capsys, monkeypatch, tmp_path):
    assert vmm.main(["--plan-only", "--quick"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out for c in vmm.CASES if c.quick)
    with pytest.raises(SystemExit, match="unknown --configs"):
        vmm.main(["--plan-only", "--configs", "nope"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        vmm.main(["--out", str(tmp_path / "x.jsonl")])
    assert not (tmp_path / "x.jsonl").exists()


# ---------------------------------------------------------------- against megatron, on the CPU
@pytest.fixture(scope="module")
def megatron_world():
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
        own = True
    else:
        own = False
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    yield
    ps.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def test_param_count_matches_megatron(megatron_world):
    for case in (TINY, dataclasses.replace(TINY, model={**TINY.model, "moe_router_topk": 1})):
        model, _ = vmm.build_gpt(case, cpu=True)
        n = sum(p.numel() for p in model.parameters())
        assert n == vmm.predict(case)["params"]


@pytest.mark.parametrize("fused", [True, False])
def test_alltoall_expert_term_matches_megatron_saved_tensors(megatron_world, monkeypatch, fused):
    """What megatron-core's experts keep for backward (the storages its autograd graph saves
    while the experts run) against the planner's e*P*(h + 3I); the unfused SwiGLU keeps three
    more (P, I) tensors (reported by the benchmark's --no-swiglu-fusion)."""
    from megatron.core.transformer.moe.router import TopKRouter

    monkeypatch.setattr(  # megatron's gating moves the router weight to CUDA; same math on CPU
        TopKRouter, "gating", lambda self, x: torch.nn.functional.linear(x, self.weight)
    )
    monkeypatch.setattr(vmm, "SWIGLU_FUSION", [fused])
    model, _ = vmm.build_gpt(TINY, cpu=True)
    mlp = model.decoder.layers[0].mlp
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = [False]
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params:
            saved.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    mlp.experts.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    mlp.experts.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    sh = mm.shapes(vmm.planner_config(TINY))
    x = torch.randn(TINY.seq, TINY.mbs, sh.h, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = mlp(x)
    out.float().sum().backward()  # the graph is a real one
    measured = sum(saved.values())
    expected = sh.e * sh.P * (sh.h + 3 * sh.I)
    if not fused:
        expected += 3 * sh.e * sh.P * sh.I
    probs = 4 * sh.P  # the fp32 per-pair probabilities, also kept
    assert expected <= measured <= expected + probs + 1024, (measured, expected)
    if fused:
        planner = mm.mlp_inner_keep_bytes(vmm.planner_config(TINY), sh, 0, "alltoall")
        router = mm.ROUTER_BYTES_PER_TOKEN_EXPERT * sh.T * sh.E
        assert planner - router == expected
