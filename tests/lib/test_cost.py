"""relaymoe.cost: bytes, memory and time by hand on a tiny shape, the mode choice, the
alltoall row count against random routing, and the planner / runtime / simulator using it."""

from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys

import pytest
import torch

from relaymoe import cost, options
from relaymoe.config import load_config
from relaymoe.planner import memory as mm
from relaymoe.planner import plan, ring_mode

# T=4 tokens, H=8, I=6, El=2 experts per rank, K=2, R=2 ranks (E=4), bf16 (2), fp32 probs (4).
# W = El*3*H*I = 288 elements (576 bytes), m = K*(4+4) = 16 metadata bytes per token.
TINY = cost.Dims(T=4, H=8, I=6, El=2, K=2, R=2, b=2, pb=4)


def kw_of(d: cost.Dims) -> dict:
    return dict(tokens=d.T, hidden=d.H, ffn=d.I, num_local_experts=d.El, topk=d.K, world=d.R,
                act_bytes=d.b, prob_bytes=d.pb)  # fmt: skip


def test_hop_and_step_bytes_by_hand():
    e = cost.hop_bytes("expert", TINY)
    assert (e.fwd_lead, e.fwd_trail, e.bwd_lead, e.bwd_trail) == (576, 0, 576, 576)
    t = cost.hop_bytes("token", TINY)
    # x 4*8*2 = 64 and metadata 4*16 = 64 lead, the output 64 trails; backward x, dy and the
    # fp32 probabilities 4*2*4 = 32 lead (no ids: the forward kept the routing indices), dx 64
    # and fp32 dprobs 32 trail (accumulators in the activations' dtype)
    assert (t.fwd_lead, t.fwd_trail, t.bwd_lead, t.bwd_trail) == (128, 64, 160, 96)
    assert t.step == 128 + 64 + 160 + 96
    # per pass: the lead R-1 = 1 times, the trail R = 2 times (the last one returns home)
    assert cost.step_bytes("expert", TINY) == cost.StepBytes(576.0, 576.0 + 2 * 576.0)
    assert cost.step_bytes("token", TINY) == cost.StepBytes(128.0 + 2 * 64, 160.0 + 2 * 96)
    # alltoall: q = 1 - C(2,2)/C(4,2) = 5/6, S = 4*2*5/6 = 20/3 rows, half of them leave;
    # forward x+metadata (16+16) out and the output (16) back, backward x and dy (32) out and
    # dx+dprobs (16+8) back
    assert cost.alltoall_rows(TINY) == pytest.approx(20 / 3)
    a = cost.step_bytes("alltoall", TINY)
    assert a.fwd == pytest.approx(10 / 3 * 48) and a.bwd == pytest.approx(10 / 3 * 56)
    assert cost.step_bytes("token", TINY, training=False).bwd == 0
    one = dataclasses.replace(TINY, R=1, El=4)
    assert all(cost.step_bytes(m, one).step == 0 for m in options.MODES)
    with pytest.raises(ValueError, match="'alltoall' is not one of"):
        cost.hop_bytes("alltoall", TINY)


def test_expert_mlp_by_hand():
    """A non-gated activation has J = I fc1 rows; biases add El*(J + H) elements to what
    travels, to the slots and to the accumulators; compute follows 2*H*(J + I) per pair."""
    plain = dataclasses.replace(TINY, gated=False)
    assert (plain.J, plain.W) == (6, 2 * (6 * 8 + 8 * 6))  # 192 elements
    biased = dataclasses.replace(TINY, b13=True, b2=True)
    assert (biased.J, biased.W) == (12, 288 + 2 * (12 + 8))  # 328 elements
    e = cost.hop_bytes("expert", biased)
    assert (e.fwd_lead, e.fwd_trail, e.bwd_lead, e.bwd_trail) == (656, 0, 656, 656)
    # slots: w13 384 -> 512, w2 192 -> 768 (aligned), b13 2*12*2 = 48 -> 1024, b2 32: 1056
    assert cost.slot_capacity("expert", biased, training=False) == 1056
    assert cost.slot_capacity("expert", plain, training=False) == 256 + 192
    model = cost.DEFAULT_TIME_MODEL
    from relaymoe.cost.time import compute_seconds

    assert compute_seconds(plain, model, False) == pytest.approx(
        compute_seconds(TINY, model, False) * 2 / 3
    )
    with pytest.raises(ValueError, match="gated=1 must be a bool"):
        dataclasses.replace(TINY, gated=1)


def test_memory_by_hand():
    # slots as the engine's layouts pack them (segments 256-aligned): expert w13 384 -> 512,
    # + w2 192 = 704; backward [weights | gradients] = 768 + 704 = 1472 (reserved at forward
    # too, a backward follows). Token forward lead x|idx|probs = 256+256+32 = 544, slot 768+64
    # = 832; backward lead x|probs|dy = 256+256+64 = 576, trail dx|dprobs = 256+32, slot
    # 768+288 = 1056.
    assert cost.slot_capacity("expert", TINY) == 1472
    assert cost.slot_capacity("expert", TINY, training=False) == 704
    assert cost.slot_capacity("token", TINY) == 1056
    assert cost.slot_capacity("token", TINY, training=False) == 832
    assert cost.slot_capacity("alltoall", TINY) == 0
    # one hop: ceil(8/2) = 4 pairs; forward (2I + I + H)*2 = 52 B, backward (4I + I + H)*2 = 76 B
    hop_f, hop_b = 4 * 52, 4 * 76
    index = 12 * 8  # the own tokens' routing index, 12 bytes per pair
    assert cost.memory_bytes("expert", TINY, transport="nccl") == cost.MemoryBytes(
        fwd=2 * 1472 + hop_f, bwd=2 * 1472 + 2 * 576 + hop_b, saved=index, workspace=0
    )
    # the copy engine's slots are the persistent workspace (2 MiB granules), not transient
    assert cost.memory_bytes("expert", TINY, transport="copy_engine") == cost.MemoryBytes(
        fwd=hop_f, bwd=2 * 576 + hop_b, saved=index, workspace=2 * 2**20 * 2
    )
    assert cost.symmetric_workspace_bytes("expert", TINY) == 4 * 2**20
    # token: output scratch 64, dx/dprobs scratch 64+32, the weight gradient 576; saved: the
    # routing index of each of the R = 2 visiting partitions, 2*96
    assert cost.memory_bytes("token", TINY, transport="nccl") == cost.MemoryBytes(
        fwd=2 * 1056 + 64 + hop_f, bwd=2 * 1056 + 96 + 576 + hop_b, saved=2 * 96, workspace=0
    )
    assert cost.memory_bytes("token", TINY, transport="nccl", weights_copy=True).fwd == (
        2 * 1056 + 64 + hop_f + 576
    )
    # alltoall: S = ceil(20/3) = 7 rows each way, T*K = 8 pairs in one call (416 / 608 B of
    # intermediates), a copy of the received ids 7*2*4 = 56
    fwd = max(7 * (16 + 32), 7 * (32 + 16), 7 * 32 + 56 + 7 * 16 + 8 * 52, 2 * 7 * 16)
    bwd = max(3 * 7 * 16, 3 * 7 * 16 + 7 * 8 + 576 + 8 * 76, 2 * 7 * 24 + 576)
    saved = 7 * 2 * (12 + 4) + 8 * 7 + 4 * 4 * 2  # index + probs, token ids, (T, R) row map
    m = cost.memory_bytes("alltoall", TINY)
    assert (m.fwd, m.bwd, m.saved, m.workspace) == (808, 1576, 312, 0) == (fwd, bwd, saved, 0)
    assert m.peak == 312 + 1576
    # inference: no backward, nothing saved
    assert cost.memory_bytes("token", TINY, training=False).bwd == 0
    assert cost.memory_bytes("token", TINY, training=False).saved == 0


def test_step_seconds_by_hand():
    # 6*T*K*H*I = 2304 FLOPs forward: at 2304 FLOP/s 1 s forward, 2 s backward; 64 B/s links
    tm = cost.TimeModel(expert_tflops=2304.0, link_bytes_per_s=64.0, hop_fixed_s=0.25,
                      call_fixed_s=1.0, alltoall_fixed_s=2.0, alltoall_bytes_per_s=104 / 3,
                      hide=0.5, nccl_hide=0.0)  # fmt: skip
    # expert: per-hop compute 0.5 s fwd, 1 s bwd. Forward hop 0 sends the weights (9 s),
    # exposed max(9 - 0.5*0.5, 0.5*9) = 8.75; backward hop 0 weights max(9 - 0.5, 4.5) = 8.5,
    # hop 1 gradients 8.5, their return home 9 (nothing to hide under)
    # step = hypot(host, device): host the fixed costs, device compute + exposed transfers
    expert = math.hypot(1.0 + 2 * 2 * 0.25, 3.0 + 8.75 + (8.5 + 8.5 + 9.0))
    assert cost.step_seconds("expert", TINY, model=tm) == pytest.approx(expert)
    # token: forward lead 2 s -> 1.75, trail 1 s -> 0.75, return 1; backward lead 2.5 s -> 2.0,
    # trail 1.5 s -> 1.0, return 1.5
    token = math.hypot(1.0 + 1.0, 3.0 + (1.75 + 0.75 + 1.0) + (2.0 + 1.0 + 1.5))
    assert cost.step_seconds("token", TINY, model=tm) == pytest.approx(token)
    # alltoall: 10/3 * (48 + 56) bytes at 104/3 B/s = 10 s, not overlapped
    assert cost.step_seconds("alltoall", TINY, model=tm) == pytest.approx(math.hypot(2.0, 13.0))
    # NCCL hides nothing with nccl_hide=0: every transfer is exposed in full
    nccl = math.hypot(1.0 + 1.0, 3.0 + (2.0 + 1.0 + 1.0) + (2.5 + 1.5 + 1.5))
    assert cost.step_seconds("token", TINY, model=tm, transport="nccl") == pytest.approx(nccl)
    assert cost.choose_mode(**kw_of(TINY), model=tm) == "token"
    assert cost.choose_mode(**kw_of(TINY), model=tm, modes=("expert", "alltoall")) == "alltoall"
    assert cost.choose_mode(**kw_of(TINY), model=tm, modes=("expert",)) == "expert"
    # forward only: one pass of each; the alltoall's host time halves
    fwd_only = math.hypot(1.0 + 2 * 0.25, 1.0 + (1.75 + 0.75 + 1.0))
    assert cost.step_seconds("token", TINY, model=tm, training=False) == pytest.approx(fwd_only)


def test_choose_mode_ties_world_of_one_and_errors():
    # every transfer hidden and no fixed costs: all three modes cost the compute alone, so the
    # order expert, token, alltoall breaks the tie
    tm = cost.TimeModel(link_bytes_per_s=1e30, alltoall_bytes_per_s=1e30, hop_fixed_s=0.0,
                      call_fixed_s=0.0, alltoall_fixed_s=0.0, hide=1.0)  # fmt: skip
    kw = kw_of(cost.Dims(T=4096, H=256, I=128, El=4, K=4, R=4, b=2, pb=4))
    assert len({cost.step_seconds(m, cost.dims(**kw), model=tm) for m in options.MODES}) == 1
    assert cost.choose_mode(**kw, model=tm) == "expert"
    assert cost.choose_mode(**kw, model=tm, modes=("alltoall", "token")) == "token"
    # a world of one is local compute whatever the mode
    one = {**kw, "world": 1, "num_local_experts": 16}
    assert cost.choose_mode(**one) == "expert"
    assert cost.choose_mode(**one, modes=("token", "alltoall")) == "expert"
    with pytest.raises(ValueError, match="'ring' is not one of"):
        cost.choose_mode(**kw, modes=("ring",))
    with pytest.raises(ValueError, match="modes is empty"):
        cost.choose_mode(**kw, modes=())
    with pytest.raises(ValueError, match="transport 'gloo'"):
        cost.choose_mode(**kw, transport="gloo")
    with pytest.raises(ValueError, match="top-k K=17 exceeds E=16"):
        cost.choose_mode(**{**kw, "topk": 17})
    with pytest.raises(ValueError, match="hidden|H=0"):
        cost.dims(**{**kw, "hidden": 0})
    with pytest.raises(ValueError, match="hide"):
        cost.TimeModel(hide=1.5)
    # tokens: every rank's T, the largest bounds the hops
    assert cost.dims(**{**kw, "tokens": [3, 4096, 7, 0]}).T == 4096
    # dtypes work as well as byte counts
    assert cost.dims(**{**kw, "act_bytes": torch.bfloat16, "prob_bytes": torch.float32}).b == 2


def test_choose_mode_deterministic_and_known_on_a_grid():
    seen = set()
    for T, H, I, El, K, R, tr in itertools.product(
        (0, 512, 8192, 131072), (1024, 4096), (256, 2048), (1, 8, 32), (1, 2, 8), (2, 4, 8, 64),
        ("copy_engine", "nccl"),
    ):  # fmt: skip
        if K > El * R:
            continue
        kw = dict(tokens=T, hidden=H, ffn=I, num_local_experts=El, topk=K, world=R,
                  act_bytes=2, prob_bytes=4, transport=tr)  # fmt: skip
        a, b = cost.choose_mode(**kw), cost.choose_mode(**kw)
        assert a == b and a in options.MODES
        d = cost.dims(**{k: v for k, v in kw.items() if k != "transport"})
        best = min(cost.step_seconds(m, d, transport=tr) for m in options.MODES)
        assert cost.step_seconds(a, d, transport=tr) == best
        seen.add(a)
    # the rows the time model was fitted to (2x H200, qwen3 widths, EP=2, bf16 probabilities):
    # the all-to-all below ~16k tokens per GPU, token mode at 64k
    q3 = dict(hidden=2048, ffn=768, num_local_experts=64, topk=8, world=2, act_bytes=2,
              prob_bytes=2)  # fmt: skip
    assert cost.choose_mode(tokens=4096, **q3) == "alltoall"
    assert cost.choose_mode(tokens=65536, **q3) == "token"
    seen.add(cost.choose_mode(tokens=65536, **q3))
    assert seen == set(options.MODES)  # the grid crosses every regime


def test_step_seconds_monotone_in_tokens():
    for mode in options.MODES:
        prev = 0.0
        for T in (0, 1024, 4096, 16384, 65536):
            s = cost.step_seconds(mode, cost.Dims(T=T, H=2048, I=768, El=16, K=8, R=8, b=2, pb=4))
            assert s >= prev, (mode, T)
            prev = s


@pytest.mark.parametrize("E,K,R", [(8, 2, 4), (16, 4, 4), (12, 3, 3)])
def test_alltoall_rows_match_random_routing(E, K, R):
    """S = T*R*q against the mean number of distinct destination ranks of random top-k rows."""
    El, T = E // R, 200_000
    g = torch.Generator().manual_seed(E * 100 + K)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]  # K distinct experts, uniform
    hit = torch.zeros(T, R, dtype=torch.bool).scatter_(1, idx // El, True)
    empirical = hit.sum().item()  # rows sent: one per (token, destination rank)
    expected = cost.alltoall_rows(cost.Dims(T=T, H=1, I=1, El=El, K=K, R=R, b=2, pb=4))
    assert abs(empirical - expected) / expected < 0.02, (empirical, expected)
    q = 1 - math.comb(E - El, K) / math.comb(E, K)
    assert expected == pytest.approx(T * R * q)


def test_slots_match_the_engine_layouts():
    """slot_capacity / symmetric_workspace_bytes against the engine's own RingPlans."""
    from relaymoe.activation import ExpertActivation
    from relaymoe.ring import executor, plan
    from relaymoe.ring.plan import RingProblem

    assert cost.ALIGN == plan.ALIGN and cost.SYMM_GRANULE == executor._SYMM_GRANULE
    mlps = [(True, False, False), (False, True, True), (True, True, False), (False, False, True)]
    for (T, H, I, El, K, R), dt, pdt, grad, (gated, b13, b2) in itertools.product(
        [(4, 8, 6, 2, 2, 2), (37, 64, 24, 3, 2, 4), (1000, 96, 40, 1, 1, 3), (0, 16, 8, 2, 2, 2)],
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (True, False),
        mlps,
    ):  # fmt: skip
        problem = RingProblem(
            rank=0, world_size=R, num_local_experts=El, hidden=H, ffn=I, topk=K, dtype=dt,
            prob_dtype=pdt, tokens=(T,) * R, mode="expert", transport="copy_engine",
            needs_grad=grad, pairs=None, activation=ExpertActivation(fn="gelu", gated=gated),
            has_b13=b13, has_b2=b2,
        )  # fmt: skip
        d = cost.Dims(T=T, H=H, I=I, El=El, K=K, R=R, b=dt.itemsize, pb=pdt.itemsize,
                      gated=gated, b13=b13, b2=b2)  # fmt: skip
        # what travels in expert mode is exactly the layout's payload
        w, dw = plan.weights_layout(problem), plan.weights_layout(problem, "d")
        payload = sum(seg.nbytes for seg in w.segments)
        assert cost.hop_bytes("expert", d).fwd_lead == payload
        assert cost.hop_bytes("expert", d).bwd_trail == sum(seg.nbytes for seg in dw.segments)
        for mode, plans in (("expert", plan.expert_plans), ("token", plan.token_plans)):
            cap = plan.capacity(*plans(problem), problem)
            assert cost.slot_capacity(mode, d, training=grad) == cap, (mode, d, grad)
            granule = cost.SYMM_GRANULE
            want = 2 * max(granule, -(-cap // granule) * granule)
            assert cost.symmetric_workspace_bytes(mode, d, training=grad) == want


def test_planner_mode_is_choose_mode_on_a_grid():
    for name in ("qwen3_30b_a3b", "table3/k4", "table3/e384", "table3/base_e128_k8_h768"):
        base = load_config(name)
        for ep, seq, mbs, tr in itertools.product(
            (1, 2, 8), (2048, 16384, 65536), (1, 4), ("auto", "nccl")
        ):
            cfg = base.replace(
                parallel={"ep": ep, "dp": max(ep // (base.parallel.tp * base.parallel.cp), 1)},
                training={"seq_length": seq, "micro_batch_size": mbs, "global_batch_size": None},
                relaymoe={"transport": tr},
            )
            sh = mm.shapes(cfg)
            want = cost.choose_mode(
                tokens=[sh.T] * ep, hidden=base.model.hidden_size,
                ffn=base.model.moe_ffn_hidden_size // base.parallel.etp,
                num_local_experts=base.model.num_experts // ep, topk=base.model.moe_router_topk,
                world=ep, act_bytes=2, prob_bytes=4,
                transport="local" if ep == 1 else ("nccl" if tr == "nccl" else "copy_engine"),
            )  # fmt: skip
            assert ring_mode(cfg) == want, (name, ep, seq, mbs, tr)
    # a forced mode is kept
    cfg = load_config("qwen3_30b_a3b").replace(relaymoe={"mode": "token"})
    assert ring_mode(cfg) == "token"


def test_issue_example_planner_sizes_the_runtime_mode():
    """H=2048, I=768, El=16, K=8, T=21504, bf16/fp32: the plan sizes memory for the mode that
    choose_mode (the runtime's auto) picks, and counts the copy engine's workspace."""
    cfg = load_config("qwen3_30b_a3b").replace(
        parallel={"tp": 1, "cp": 1, "pp": 1, "ep": 8, "dp": 8, "sequence_parallel": False},
        training={"seq_length": 21504, "micro_batch_size": 1, "global_batch_size": None},
        model={"num_layers": 4},
    )
    sh = mm.shapes(cfg)
    assert (sh.T, sh.h, sh.I, sh.El, sh.K) == (21504, 2048, 768, 16, 8)
    want = cost.choose_mode(tokens=[21504] * 8, hidden=2048, ffn=768, num_local_experts=16,
                          topk=8, world=8, act_bytes=2, prob_bytes=4)  # fmt: skip
    p = plan(cfg, "h200-141gb")
    assert p.routing_mode == want
    assert p.moe_peak_bytes["ring"] == mm.moe_peak_ring(sh, want, "copy_engine")
    ws = cost.memory_bytes(want, sh.dims(), transport="copy_engine").workspace
    assert p.breakdown["ring"]["symmetric_workspace"] == ws
    # a ring mode over the copy engine counts its workspace once in the stage peak
    from relaymoe.planner import stage_peak

    forced = cfg.replace(relaymoe={"mode": "expert"})
    a = stage_peak(forced, 0, "ring")
    b = stage_peak(forced.replace(relaymoe={"transport": "nccl"}), 0, "ring")
    assert a.terms["symmetric_workspace"] == cost.symmetric_workspace_bytes("expert", sh.dims()) > 0
    assert b.terms["symmetric_workspace"] == 0
    slots = 2 * cost.slot_capacity("expert", sh.dims())
    assert b.terms["moe_block_peak"] - a.terms["moe_block_peak"] == slots


def test_cost_model_options_and_planner_import_no_torch():
    """The cost model and the option names are pure Python: importing them (and the planner)
    loads no torch, and their files import nothing of relaymoe but each other."""
    code = (
        "import sys, ast, pathlib\n"
        "import relaymoe.cost, relaymoe.options, relaymoe.planner\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "files = [*pathlib.Path(relaymoe.cost.__file__).parent.glob('*.py'),\n"
        "         pathlib.Path(relaymoe.options.__file__)]\n"
        "for f in files:\n"
        "    tree = ast.parse(f.read_text())\n"
        "    nodes = list(ast.walk(tree))\n"
        "    names = [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]\n"
        "    names += [n.module for n in nodes if isinstance(n, ast.ImportFrom)]\n"
        "    bad = [n for n in names if n.startswith('torch') or (n.startswith('relaymoe')\n"
        "           and not n.startswith(('relaymoe.cost', 'relaymoe.options')))]\n"
        "    assert not bad, (f.name, bad)\n"
        "assert len(files) >= 7, files\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# -- schedules (issue #18): flat ring or two-level over nodes ---------------------------------

# TINY's sizes over R=4 ranks, 2 per node: 1 s forward compute (0.25 s a hop), 2 s backward
TINY4 = dataclasses.replace(TINY, R=4)
TM_HOPS = cost.TimeModel(expert_tflops=2304.0, link_bytes_per_s=64.0, hop_fixed_s=0.25,
                       call_fixed_s=1.0, hide=0.5, nccl_hide=0.0)  # fmt: skip


def test_ring_hop_times_by_hand():
    """Expert mode, 576 B of weights (9 s inside a node at 64 B/s, 18 s across at 32 B/s).
    Two-level, nodes {0,1} {2,3}: forward lead intra (exposed 9 - 0.5*0.25), inter (NCCL hides
    nothing: 18), intra; backward lead intra 8.75, then lead across + trail inside (18), lead
    inside + trail across (18), trail inside 8.75, trail home across 18. Flat across nodes:
    every hop has a link across (ranks 1 and 3), NCCL everywhere."""
    kw = dict(gpus_per_node=2, model=TM_HOPS, inter_bytes_per_s=32.0)
    two = cost.ring_hop_times("expert", TINY4, schedule="two_level", **kw)
    fwd, bwd = 8.875 + 18 + 8.875, 8.75 + 18 + 18 + 8.75 + 18
    assert two.host_s == pytest.approx(1.0 + 2 * 4 * 0.25)
    assert two.device_s == pytest.approx(3.0 + fwd + bwd)
    assert two.step_s == pytest.approx(math.hypot(3.0, 3.0 + fwd + bwd))
    assert (two.intra_hops, two.inter_hops) == (3 + 2, 1 + 3)
    assert two.inter_hop_s == pytest.approx(0.5 + 18) and two.intra_hop_s == pytest.approx(9.25)
    assert (two.inter_transfer_s, two.intra_transfer_s) == (18.0, 9.0)
    flat = cost.ring_hop_times("expert", TINY4, schedule="flat", **kw)
    assert flat.device_s == pytest.approx(3.0 + 3 * 18 + (18 + 36 + 36 + 18 + 18))
    assert (flat.intra_hops, flat.inter_hops) == (1, 3 + 5)  # the forward's last hop sends nothing
    assert two.nodes == flat.nodes == 2


@pytest.mark.parametrize("mode", options.RING_MODES)
@pytest.mark.parametrize("transport", options.LINK_TRANSPORTS)
def test_ring_hop_times_in_one_node_are_step_seconds(mode, transport):
    for R, T, training in itertools.product((2, 3, 8), (64, 4096), (True, False)):
        d = cost.Dims(T=T, H=2048, I=768, El=4, K=8, R=R, b=2, pb=4)
        want = cost.step_seconds(mode, d, transport=transport, training=training)
        for sched, G in itertools.product(options.SCHEDULES, (None, R, 2 * R)):
            t = cost.ring_hop_times(mode, d, schedule=sched, gpus_per_node=G,
                                  transport=transport, training=training)  # fmt: skip
            assert t.step_s == pytest.approx(want, rel=1e-12), (sched, G)
            assert t.inter_hops == 0


def test_schedule_order_visits_every_rank_once_and_crosses_nodes_rarely():
    for R, G in ((4, 2), (6, 2), (6, 3), (16, 4), (64, 8), (8, 1)):
        N = R // G
        for sched in options.SCHEDULES:
            inter = 0
            for p in range(R):
                path = [cost.schedule_rank(sched, s, p, R, G) for s in range(R)]
                assert path[0] == p and sorted(path) == list(range(R)), (sched, R, G, p)
                for a, b in zip(path, path[1:], strict=False):
                    if a // G != b // G:
                        inter += 1
                        if sched == "two_level":  # the same local rank of the next node
                            assert (a % G, b // G) == (b % G, (a // G + 1) % N)
                    elif sched == "two_level":  # the node's ring
                        assert b % G == (a % G + 1) % G
            # lead hops across nodes over all partitions: flat one link per node every hop
            want = R * (N - 1) if sched == "two_level" else (R - 1) * N
            assert inter == (want if N > 1 else 0), (sched, R, G, inter)


def test_schedule_order_is_the_runtimes():
    from relaymoe.ring.plan import RingPlan

    for R, G in ((4, 2), (6, 3), (6, 2), (16, 4)):
        plan_ = RingPlan(0, R, [1] * R, None, gpus_per_node=G)
        for s, p in itertools.product(range(R), range(R)):
            assert plan_.who(s, p) == cost.schedule_rank("two_level", s, p, R, G)
        flat = RingPlan(0, R, [1] * R, None)
        for s, p in itertools.product(range(R), range(R)):
            assert flat.who(s, p) == cost.schedule_rank("flat", s, p, R, G)


def test_two_level_never_slower_and_chosen_across_nodes():
    worst = math.inf
    for mode, R, G, T in itertools.product(options.RING_MODES, (8, 16, 32, 64), (2, 4, 8),
                                           (1024, 32768, 98304)):  # fmt: skip
        if R > G and R % G:
            continue
        d = cost.Dims(T=T, H=2048, I=768, El=128 // R, K=8, R=R, b=2, pb=4)
        t = {
            s: cost.ring_hop_times(mode, d, schedule=s, gpus_per_node=G) for s in options.SCHEDULES
        }
        worst = min(worst, t["flat"].step_s / t["two_level"].step_s)
        assert t["two_level"].inter_hops < t["flat"].inter_hops or G >= R
        want = "two_level" if G < R else "flat"
        assert cost.choose_schedule(world=R, gpus_per_node=G) == want
    assert worst >= 1.0 - 1e-12, worst


def test_node_batched_pays_one_hop_per_node_and_wins_across_many_nodes():
    """The planner's node-batched rounds: N = R/G hops a pass (the gradients' hop home besides),
    the fixed host cost per hop, and across many nodes a faster step than the two-level ring;
    never chosen by ``auto``."""
    m = cost.DEFAULT_TIME_MODEL
    d = cost.Dims(T=98304, H=2048, I=768, El=2, K=8, R=64, b=2, pb=4)
    nb = cost.node_batched_hop_times(d, gpus_per_node=8)
    assert (nb.schedule, nb.inter_hops, nb.intra_hops) == (options.NODE_BATCHED, 2 * 8 + 1, 0)
    assert nb.host_s == pytest.approx(m.call_fixed_s + 2 * 8 * m.hop_fixed_s)
    two = cost.ring_hop_times("expert", d, schedule="two_level", gpus_per_node=8)
    assert nb.step_s < two.step_s / 2, (nb.step_s, two.step_s)
    one = cost.node_batched_hop_times(dataclasses.replace(d, R=8, El=16), gpus_per_node=8)
    assert (one.inter_hops, one.intra_hops, one.inter_transfer_s) == (0, 2, 0.0)  # one round
    fwd = cost.node_batched_hop_times(d, gpus_per_node=8, training=False)
    assert fwd.inter_hops == 8 and fwd.host_s == pytest.approx(m.call_fixed_s + 8 * m.hop_fixed_s)
    assert cost.choose_schedule(world=64, gpus_per_node=8) == "two_level"


def test_choose_schedule_and_its_errors():
    assert cost.choose_schedule(world=8) == "flat"  # one node
    assert cost.choose_schedule(world=8, gpus_per_node=1) == "flat"  # both orders are the same
    assert cost.choose_schedule(world=16, gpus_per_node=8) == "two_level"
    assert cost.choose_schedule(world=16, gpus_per_node=8, requested="flat") == "flat"
    with pytest.raises(ValueError, match="whole number of nodes"):
        cost.choose_schedule(world=12, gpus_per_node=8)
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        cost.choose_schedule(world=8, gpus_per_node=0)
    with pytest.raises(ValueError, match="schedule 'ring'"):
        cost.choose_schedule(world=8, requested="ring")
    with pytest.raises(ValueError, match="schedule 'auto'"):
        cost.ring_hop_times("expert", TINY4, schedule=options.AUTO)
    with pytest.raises(ValueError, match="mode 'alltoall'"):
        cost.ring_hop_times("alltoall", TINY4, schedule="flat")


def test_grad_accumulators_widen_expert_mode_backward_bytes_and_memory():
    """fp32 weight-gradient accumulators (``grad_accum``): expert mode's backward trail and its
    slots, scratch and returned gradient (plus its cast) grow; nothing else moves."""
    assert cost.grad_accum_bytes("param", 64, 2) == 2 and cost.grad_accum_bytes("fp32", 2, 2) == 4
    lo = options.FP32_GRAD_ACCUM_MIN_EP
    assert (
        cost.grad_accum_bytes("auto", lo - 1, 2) == 2 and cost.grad_accum_bytes("auto", lo, 2) == 4
    )
    assert cost.grad_accum_bytes("fp32", 2, torch.float32) == 4  # fp32 weights: nothing to widen
    with pytest.raises(ValueError, match="grad_accum='fp16' is not one of"):
        cost.grad_accum_bytes("fp16", 2, 2)
    kw = dict(tokens=4096, hidden=2048, ffn=768, num_local_experts=8, topk=8, world=16)
    wide, narrow = cost.dims(**kw), cost.dims(**kw, grad_accum="param")
    assert (wide.gb, narrow.gb) == (4, 2) and dataclasses.replace(narrow, gb=4) == wide
    he, ne = cost.hop_bytes("expert", wide), cost.hop_bytes("expert", narrow)
    assert he.bwd_trail == 2 * ne.bwd_trail == 2 * ne.bwd_lead and he.fwd == ne.fwd
    assert cost.hop_bytes("token", wide) == cost.hop_bytes("token", narrow)
    W = wide.W
    assert cost.slot_capacity("expert", wide) - cost.slot_capacity("expert", narrow) >= 2 * W
    mw = cost.memory_bytes("expert", wide, transport="nccl")
    mn = cost.memory_bytes("expert", narrow, transport="nccl")
    assert mw.fwd - mn.fwd == 2 * (cost.slot_capacity("expert", wide) - cost.slot_capacity(
        "expert", narrow))  # fmt: skip
    assert mw.bwd - mn.bwd >= 6 * W  # scratch +2W, returned +2W, its cast to bf16 +2W (+slots)
    tw, tn = cost.memory_bytes("token", wide), cost.memory_bytes("token", narrow)
    assert tw.bwd - tn.bwd == 4 * W and tw.fwd == tn.fwd  # the local sums in fp32 and the cast
    # Dims refuses a zero-byte accumulator only through its default (0 means b)
    assert cost.Dims(1, 1, 1, 1, 1, 1, 2, 4).gb == 2


def test_captured_hops_model_swaps_the_hop_host_cost_only():
    """``TimeModel.captured_hops()`` is the model with each ring hop's host time that of a
    replayed hop, nothing else: at qwen3 widths, EP 2 and 4k tokens a GPU the eager ring is
    host-bound and loses to the all-to-all, the captured estimate makes a ring mode the
    fastest; the all-to-all's own time does not move."""
    m = cost.DEFAULT_TIME_MODEL
    c = m.captured_hops()
    assert c.hop_fixed_s == m.captured_hop_fixed_s < m.hop_fixed_s
    assert dataclasses.replace(c, hop_fixed_s=m.hop_fixed_s) == m
    kw = dict(tokens=4096, hidden=2048, ffn=768, num_local_experts=64, topk=8, world=2)
    d = cost.dims(**kw)
    assert cost.step_seconds("alltoall", d, model=c) == cost.step_seconds("alltoall", d)
    assert cost.choose_mode(**kw) == "alltoall"
    assert cost.choose_mode(**kw, model=c) in options.RING_MODES
    with pytest.raises(ValueError, match="captured_hop_fixed_s"):
        cost.TimeModel(captured_hop_fixed_s=-1.0)


def test_main_grads_drop_the_weight_gradient_buffers_the_kernel_adds_in_place():
    """``memory_bytes(main_grads=True)`` (``ring_moe(main_grads=)``, Megatron's fusion): where
    the weight-gradient kernel adds into the caller's accumulators (a world of one, token and
    alltoall modes) no accumulator and no cast exist; expert mode over a ring still brings its
    gradient home (``W*gb``) and only the cast goes. Nothing else moves."""
    W = TINY.W
    kw = dict(tokens=4096, hidden=2048, ffn=768, num_local_experts=8, topk=8, world=16)
    wide = cost.dims(**kw)  # fp32 accumulators (gb 4) of bf16 weights: the cast exists
    one = dataclasses.replace(TINY, R=1, El=4)
    for d, mode, gone in (
        (TINY, "token", W * 2),
        (wide, "token", wide.W * (4 + 2)),
        (TINY, "alltoall", W * 2),
        (TINY, "expert", 0),
        (wide, "expert", wide.W * 2),  # the cast only
        (one, "expert", one.W * 2),
        (one, "token", one.W * 2),
        (dataclasses.replace(one, gb=4), "expert", one.W * (4 + 2)),
    ):
        for tr in ("nccl", "copy_engine"):
            plain = cost.memory_bytes(mode, d, transport=tr)
            fused = cost.memory_bytes(mode, d, transport=tr, main_grads=True)
            assert plain.bwd - fused.bwd == gone, (mode, d.R, d.gb, tr)
            assert (plain.fwd, plain.saved, plain.workspace) == (
                fused.fwd, fused.saved, fused.workspace)  # fmt: skip
    # node-batched rounds of one GPU a node are the flat expert ring's, main_grads included
    assert cost.node_batched_memory_bytes(wide, gpus_per_node=1, main_grads=True) == (
        cost.memory_bytes("expert", wide, transport="nccl", main_grads=True))  # fmt: skip
