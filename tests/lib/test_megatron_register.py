"""register(), the parser, the refusals and the small pieces of relaymoe.megatron (in-process)."""

from __future__ import annotations

import argparse
import copy
import os
import types
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tests.fixtures import tiny_transformer_config

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def mcore():
    import relaymoe.megatron as rm

    rm.register()
    return rm


def _config(**kw):
    return tiny_transformer_config(
        **{"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "ring", **kw}
    )


def test_import_relaymoe_megatron_does_not_import_megatron():
    import subprocess
    import sys

    code = (
        "import sys, relaymoe, relaymoe.megatron; "
        "assert 'megatron.core' not in sys.modules, 'imported megatron eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_twice_is_harmless(mcore):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training import arguments

    from relaymoe.megatron.patches import patched_everything

    before = (MoELayer.__init__, MoELayer.routed_experts_compute, arguments.add_megatron_arguments)
    mcore.register()
    mcore.register()
    after = (MoELayer.__init__, MoELayer.routed_experts_compute, arguments.add_megatron_arguments)
    assert before == after, "a second register() re-wrapped something"
    assert mcore.is_registered() and patched_everything()
    # the parser still has exactly one 'ring' choice and one relaymoe group
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    (action,) = [a for a in parser._actions if a.dest == "moe_token_dispatcher_type"]
    assert list(action.choices).count("ring") == 1
    assert sum(a.dest == "relaymoe_mode" for a in parser._actions) == 1


def test_parser_accepts_ring_and_relaymoe_flags(mcore):
    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ns = parser.parse_args(
        "--moe-token-dispatcher-type ring --relaymoe-mode token --relaymoe-transport nccl".split()
    )
    assert ns.moe_token_dispatcher_type == "ring"
    assert (ns.relaymoe_mode, ns.relaymoe_transport) == ("token", "nccl")
    assert parser.parse_args([]).relaymoe_mode == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--relaymoe-mode", "sideways"])
    ns = parser.parse_args("--relaymoe-schedule two_level --relaymoe-gpus-per-node 8".split())
    assert (ns.relaymoe_schedule, ns.relaymoe_gpus_per_node) == ("two_level", 8)
    defaults = parser.parse_args([])
    assert (defaults.relaymoe_schedule, defaults.relaymoe_gpus_per_node) == ("auto", None)
    assert defaults.relaymoe_grad_accum == "auto"
    assert parser.parse_args(["--relaymoe-grad-accum", "fp32"]).relaymoe_grad_accum == "fp32"
    assert defaults.relaymoe_host_wait is None  # the environment's, else lag
    assert defaults.relaymoe_hop_slice_mib is None  # the environment's, else the default
    for mib in (0, 1024):  # 0: never sliced
        ns = parser.parse_args(["--relaymoe-hop-slice-mib", str(mib)])
        assert ns.relaymoe_hop_slice_mib == mib
    wait = parser.parse_args(["--relaymoe-host-wait", "pass"]).relaymoe_host_wait
    assert wait == "pass"
    for bad in (["--relaymoe-schedule", "tree"], ["--relaymoe-gpus-per-node", "0"],
                ["--relaymoe-grad-accum", "fp16"], ["--relaymoe-hop-slice-mib", "-1"],
                ["--relaymoe-hop-slice-mib", "lots"],
                ["--relaymoe-host-wait", "hop"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    # megatron's own parser (the unpatched function) rejects ring: the patch is what adds it
    original = arguments.add_megatron_arguments.__relaymoe_original__
    plain = original(argparse.ArgumentParser(allow_abbrev=False))
    with pytest.raises(SystemExit):
        plain.parse_args(["--moe-token-dispatcher-type", "ring"])


def test_ring_flags_of_a_config_parse(mcore):
    from megatron.training import arguments

    from relaymoe.config import load_config, to_megatron_args
    from relaymoe.megatron import settings

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    cfg = load_config("qwen3_30b_a3b").replace(parallel={"gpus_per_node": 4})
    ns = parser.parse_args(to_megatron_args(cfg, dispatcher="ring"))
    assert (ns.moe_token_dispatcher_type, ns.relaymoe_gpus_per_node) == ("ring", 4)
    assert ns.relaymoe_hop_slice_mib is None  # the default budget renders no flag
    # a config's hop slice budget reaches the ring's kernel options through its flag
    sliced = cfg.replace(relaymoe={"hop_slice_mib": 1024})
    ns = parser.parse_args(to_megatron_args(sliced, dispatcher="ring"))
    assert settings.ring_config_from_args(ns).kernels.hop_slice_mib == 1024


def test_ep_ranks_per_node_from_global_ranks():
    from relaymoe.megatron.dispatcher import ep_ranks_per_node

    assert ep_ranks_per_node(list(range(16)), None) is None  # the hosts decide
    assert ep_ranks_per_node(list(range(16)), 8) == 8  # two nodes of 8
    assert ep_ranks_per_node(list(range(8, 16)), 8) == 8  # inside one node: flat later
    assert ep_ranks_per_node([0, 2, 4, 6, 8, 10, 12, 14], 8) == 4  # every other GPU (tp 2)
    assert ep_ranks_per_node([0, 8, 16, 24], 8) == 1  # one EP rank per node
    with pytest.raises(ValueError, match=r"--relaymoe-gpus-per-node 8: the EP group's global "
                                         r"ranks \[4, 5, 6, 7, 8, 9\]"):  # fmt: skip
        ep_ranks_per_node([4, 5, 6, 7, 8, 9], 8)  # 4 on node 0, 2 on node 1


def test_ring_config_and_configure(mcore):
    """The ring's options are one ``relaymoe.options.RingConfig`` (one schema), the fused loss a
    ``FusedLoss``; ``configure`` attaches whole objects to a TransformerConfig and refuses other
    types; bad values are refused when the objects are built."""
    from relaymoe import options
    from relaymoe.megatron import settings

    class Config:  # a TransformerConfig stand-in
        pass

    cfg = Config()
    assert settings.ring_config_of(cfg) == options.RingConfig()  # nothing parsed: the defaults
    ring = options.RingConfig(mode="expert", overlap=False)
    assert mcore.configure(cfg, ring=ring) is cfg
    assert settings.ring_config_of(cfg) is ring
    assert settings.ring_config_of(Config()) == options.RingConfig()  # another model's: its own
    for bad, match in ((dict(mode="diagonal"), "mode='diagonal' is not one of"),
                       (dict(schedule="tree"), "schedule='tree' is not one of"),
                       (dict(gpus_per_node=0), r"gpus_per_node=0 must be an int in \[1, "),
                       (dict(grad_accum="fp16"), "grad_accum='fp16' is not one of"),
                       (dict(host_wait="always"), "host_wait='always' is not one of")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            options.RingConfig(**bad)
    with pytest.raises(ValueError, match="loss_chunk_tokens=0 must be"):
        settings.FusedLoss(chunk_tokens=0)
    with pytest.raises(ValueError, match="pass a relaymoe.options.RingConfig"):
        mcore.configure(cfg, ring={"mode": "expert"})
    assert settings.ring_config_of(cfg) is ring  # a refused configure changes nothing


def test_ring_config_from_parsed_megatron_args(mcore):
    """Each ``--relaymoe-<field>`` flag given becomes that field; an unset environment-backed
    flag (the host wait) keeps the base's value: the environment's, which the patched
    ``validate_args`` reads once (``build_ring_config``) onto ``args.relaymoe_ring``."""
    from megatron.training import arguments

    from relaymoe import options
    from relaymoe.megatron import settings
    from relaymoe.megatron.patches import build_ring_config

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ns = parser.parse_args("--relaymoe-mode token --relaymoe-fused-loss "
                           "--relaymoe-loss-chunk-tokens 64".split())  # fmt: skip
    ring = settings.ring_config_from_args(ns)
    assert ring.mode == "token" and settings.fused_loss_from_args(ns) == settings.FusedLoss(
        True, 64)  # fmt: skip
    assert ring.host_wait == options.RingConfig().host_wait
    base = options.RingConfig(host_wait="pass")
    assert settings.ring_config_from_args(parser.parse_args([]), base).host_wait == "pass"
    ns = parser.parse_args(["--relaymoe-host-wait", "off"])
    assert settings.ring_config_from_args(ns, base).host_wait == "off"
    # the entry point: the environment under the flags, kept on the arguments
    ns = parser.parse_args(["--relaymoe-mode", "expert"])
    env = {"RELAYMOE_RING_HOST_WAIT": "pass", "RELAYMOE_AUTOTUNE": "0"}
    with mock.patch.dict(os.environ, env):
        built = build_ring_config(ns)
    assert ns.relaymoe_ring is built
    assert (built.mode, built.host_wait, built.kernels.autotune) == ("expert", "pass", "first")


def test_supported_config_passes(mcore):
    cfg = _config(
        moe_shared_expert_intermediate_size=16,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
    )
    assert cfg.moe_token_dispatcher_type == "ring"
    from relaymoe.megatron.validate import ring_config_problems

    assert ring_config_problems(cfg) == []
    # TP with sequence parallelism and expert-TP 1 is fine; CUDA graphs over attention only too
    ok = copy.copy(cfg)
    ok.tensor_model_parallel_size, ok.sequence_parallel, ok.expert_tensor_parallel_size = 2, True, 1
    ok.cuda_graph_impl, ok.cuda_graph_modules = "transformer_engine", ["attn"]
    assert ring_config_problems(ok) == []


REFUSALS = [
    (
        dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2),
        "--expert-tensor-parallel-size 1",
    ),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True), "inherited from TP"),
    (
        dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1),
        "fix: add --sequence-parallel",
    ),
    (dict(moe_expert_capacity_factor=1.0), "remove --moe-expert-capacity-factor"),
    (dict(moe_pad_expert_input_to_capacity=True), "remove --moe-pad-expert-input-to-capacity"),
    (
        dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True),
        "remove --moe-shared-expert-overlap",
    ),
    (dict(overlap_moe_expert_parallel_comm=True), "remove --overlap-moe-expert-parallel-comm"),
    (dict(moe_enable_deepep=True), "remove --moe-enable-deepep"),
    (dict(moe_flex_dispatcher_num_sms=20), "remove --moe-flex-dispatcher-num-sms"),
    (dict(moe_hybridep_num_sms=20), "remove --moe-hybridep-num-sms"),
    (dict(fp8="e4m3", fp8_param=True), "--fp8-param-gather"),
    (dict(fp4="e2m1"), "fp4='e2m1'"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn", "moe_router"]),
     "per-layer CUDA graphs over part of the MoE layer"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe_router"]),
     "the ring runs captured in both, dropless"),
    (dict(num_moe_experts=6, expert_model_parallel_size=4), "not divisible by the expert-parallel"),
    (dict(activation_func=torch.tanh), "activation_func=torch.tanh is not one"),
    (dict(gated_linear_unit=False, activation_func=F.gelu, activation_func_clamp_value=7.0),
     "applies it to gated units only"),
    (dict(activation_func_clamp_value=7.0, bias_activation_fusion=True),
     "fused SwiGLU ignores the clamp"),
    (dict(moe_apply_probs_on_input=True, moe_router_topk=1), "moe_apply_probs_on_input"),
    (dict(moe_latent_size=8), "latent MoE"),
    (dict(moe_mlp_glu_interleave_size=4), "moe_mlp_glu_interleave_size"),
    (dict(moe_grouped_gemm=True, moe_single_grouped_weight=True),
     "remove --moe-single-grouped-weight"),
]  # fmt: skip


@pytest.mark.parametrize("kw,message", REFUSALS, ids=[m for _, m in REFUSALS])
def test_refused_at_config_time(mcore, kw, message):
    with pytest.raises(ValueError) as info:
        _config(**kw)
    text = str(info.value)
    assert "--moe-token-dispatcher-type ring cannot run" in text
    assert message in text, text
    assert "fix" in text


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_fp8_recipes_run_the_experts_in_fp8_with_a_notice(mcore, fmt, recipe):
    """fp8 recipes run: TE computes attention and dense layers in fp8; ``--relaymoe-fp8-experts
    on`` runs the ring's experts in fp8 too, saying which GEMMs; ``auto`` (the default) keeps
    them in bf16, since no recipe's fp8 experts are measured faster, saying so with the
    measured rows and what ``on`` would run; ``off`` keeps them bf16; fp8 primary weights are
    refused (the ring quantises from the bf16 parameters)."""
    from relaymoe.megatron.fp8_experts import FP8_EXPERT_MS, fp8_recipe_of
    from relaymoe.megatron.settings import configure
    from relaymoe.megatron.validate import fp8_expert_notice, ring_config_problems
    from relaymoe.options import RingConfig

    cfg = copy.copy(_config())
    cfg.fp8, cfg.fp8_recipe, cfg.hidden_size, cfg.moe_ffn_hidden_size = fmt, recipe, 256, 128
    configure(cfg, ring=RingConfig(fp8_experts="on"))
    assert ring_config_problems(cfg) == []
    notice = fp8_expert_notice(cfg)
    assert fmt in notice and recipe in notice and "(--relaymoe-fp8-experts on)" in notice, notice
    assert "routed experts run fprop/dgrad" in notice, notice
    assert ("and wgrad in bf16" in notice) == (recipe == "blockwise"), notice
    r = fp8_recipe_of(cfg)
    assert (r.recipe, r.fmt, r.fp8_wgrad) == (recipe, fmt, recipe != "blockwise")
    cfg.fp8_wgrad = False  # --no-fp8-wgrad: every recipe's weight gradients in bf16
    assert fp8_recipe_of(cfg).fp8_wgrad is False and "and wgrad in bf16" in fp8_expert_notice(cfg)
    cfg.fp8_wgrad = True
    configure(cfg, ring=RingConfig())  # auto: bf16 experts, why, and what on would run
    assert fp8_recipe_of(cfg) is None and ring_config_problems(cfg) == []
    notice = fp8_expert_notice(cfg)
    kernels = "tensorwise" if recipe == "delayed" else recipe
    ms = FP8_EXPERT_MS["qwen3_30b_a3b_T32k"]
    assert "routed experts compute in bf16: --relaymoe-fp8-experts auto keeps them" in notice
    assert f"{ms[kernels]} ms against bf16's {ms['bf16']} ms at qwen3_30b_a3b_T32k" in notice
    assert "--relaymoe-fp8-experts on runs their fprop/dgrad" in notice, notice
    configure(cfg, ring=RingConfig(fp8_experts="off"))
    assert fp8_recipe_of(cfg) is None
    assert "experts compute in bf16 (--relaymoe-fp8-experts off)" in fp8_expert_notice(cfg)
    cfg.fp8_param = True
    (problem,) = ring_config_problems(cfg)
    assert "--fp8-param-gather" in problem and "fix: remove" in problem
    args = types.SimpleNamespace(moe_token_dispatcher_type="ring", fp8=fmt, fp8_recipe=recipe,
                                 fp8_param_gather=True, swiglu=True)  # fmt: skip
    assert any("--fp8-param-gather" in p for p in ring_config_problems(args, args_style=True))
    cfg.fp8 = None
    assert fp8_expert_notice(cfg) is None
    cfg.fp8, cfg.moe_token_dispatcher_type = fmt, "alltoall"
    assert fp8_expert_notice(cfg) is None  # not the ring's to announce


def test_auto_runs_fp8_experts_only_where_measured_faster(mcore, monkeypatch):
    """``auto`` follows the measurement (``FP8_EXPERT_MS``): fp8 where a recipe's kernels were
    faster than bf16 on every shape (delayed runs the tensorwise kernels), bf16 otherwise,
    and nothing is decided from an unmeasured or unimplemented recipe."""
    from relaymoe.megatron import fp8_experts

    assert not any(fp8_experts.auto_runs_fp8(r) for r in ("tensorwise", "delayed", "blockwise"))
    faster = {"a": {"bf16": 10.0, "tensorwise": 6.0, "blockwise": 9.0},
              "b": {"bf16": 20.0, "tensorwise": 12.0, "blockwise": 21.0}}  # fmt: skip
    monkeypatch.setattr(fp8_experts, "FP8_EXPERT_MS", faster)
    assert fp8_experts.auto_runs_fp8("tensorwise") and fp8_experts.auto_runs_fp8("delayed")
    assert not fp8_experts.auto_runs_fp8("blockwise")  # slower on one shape
    assert not fp8_experts.auto_runs_fp8("mxfp8")
    args = types.SimpleNamespace(moe_token_dispatcher_type="ring", fp8="hybrid",
                                 fp8_recipe="delayed", relaymoe_fp8_experts="auto")  # fmt: skip
    assert fp8_experts.fp8_recipe_of(args).recipe == "delayed"
    args.fp8_recipe = "blockwise"
    assert fp8_experts.fp8_recipe_of(args) is None
    assert "21.0 ms against bf16's 20.0 ms at b" in fp8_experts.auto_bf16_reason("blockwise")


FP8_REFUSALS = [
    ({"fp8_recipe": "mxfp8"}, "fp8_recipe='mxfp8'"),
    (
        {"fp8_recipe": "blockwise", "hidden_size": 192},
        "hidden_size=192 with --fp8-recipe blockwise",
    ),
    ({"fp8_recipe": "blockwise", "moe_ffn_hidden_size": 96}, "moe_ffn_hidden_size=96 with"),
    ({"add_bias_linear": True}, "add_bias_linear=True: the fp8 experts take no biases"),
    ({"relaymoe_mode": "token"}, "relaymoe_mode='token': the fp8 experts run in expert mode"),
    ({"relaymoe_schedule": "node_batched"}, "relaymoe_schedule='node_batched'"),
    ({"cuda_graph_impl": "full_iteration"}, "the fp8 experts are not captured yet"),
]


@pytest.mark.parametrize("kw,message", FP8_REFUSALS, ids=[m[:24] for _, m in FP8_REFUSALS])
def test_fp8_experts_refused_at_config_time(mcore, kw, message):
    """What the fp8 experts cannot run is refused by name with ``on``, with both fixes; ``off``
    and ``auto`` (bf16 experts while fp8 is not measured faster) accept it."""
    from relaymoe.megatron.validate import ring_config_problems

    args = types.SimpleNamespace(moe_token_dispatcher_type="ring", fp8="hybrid",
                                 fp8_recipe="tensorwise", swiglu=True, hidden_size=256,
                                 moe_ffn_hidden_size=128, **{"cuda_graph_modules": ["moe"]} if (
                                     "cuda_graph_impl" in kw) else {})  # fmt: skip
    for k, v in kw.items():
        setattr(args, k, v)
    assert not [p for p in ring_config_problems(args, args_style=True) if message in p]  # auto
    args.relaymoe_fp8_experts = "on"
    problems = ring_config_problems(args, args_style=True)
    hits = [p for p in problems if message in p]
    assert hits, problems
    assert "--relaymoe-fp8-experts off" in hits[0] and "fix" in hits[0]
    args.relaymoe_fp8_experts = "off"
    assert not [p for p in ring_config_problems(args, args_style=True) if "fp8 experts" in p]


def test_fp8_experts_off_reaches_a_config_built_from_megatron_arguments(mcore, monkeypatch):
    """A ``TransformerConfig`` carries no ``--relaymoe-*`` value: the option comes from the
    model's ring config (Megatron's parsed arguments), so ``on`` brings the fp8 refusals and
    ``off`` lifts them."""
    from relaymoe.megatron import settings
    from relaymoe.megatron.validate import ring_config_problems
    from relaymoe.options import RingConfig

    cfg = copy.copy(_config())
    cfg.fp8, cfg.fp8_recipe, cfg.add_bias_linear = "hybrid", "tensorwise", True
    monkeypatch.setattr(settings, "ring_config_of", lambda c: RingConfig(fp8_experts="on"))
    assert any("fp8 experts take no biases" in p for p in ring_config_problems(cfg))
    monkeypatch.setattr(settings, "ring_config_of", lambda c: RingConfig(fp8_experts="off"))
    assert not any("fp8 experts" in p for p in ring_config_problems(cfg))


def test_layer_fp8_state_refuses_a_gpu_before_hopper(mcore, monkeypatch):
    """The dispatcher's state: None without fp8, with off, or with auto (fp8 not measured
    faster); with on, a pre-Hopper GPU named."""
    import torch

    from relaymoe.megatron.fp8_experts import layer_fp8_state

    args = types.SimpleNamespace(moe_token_dispatcher_type="ring", fp8="e4m3",
                                 fp8_recipe="blockwise")  # fmt: skip
    assert layer_fp8_state(args, "off") is None and layer_fp8_state(args, "auto") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA A100")
    with pytest.raises(ValueError, match="NVIDIA A100 has capability 8.0 .*fp8-experts off"):
        layer_fp8_state(args, "on")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (9, 0))
    state = layer_fp8_state(args, "on")
    assert state.recipe.recipe == "blockwise" and state.recipe.fmt == "e4m3"


def test_fp8_notice_printed_on_rank_0_only(mcore, capsys):
    """Megatron's argument validation (patched) prints the fp8 notice once, on rank 0."""
    from relaymoe.megatron.patches import announce_fp8_experts

    ns = types.SimpleNamespace(moe_token_dispatcher_type="ring", fp8="hybrid",
                               fp8_recipe="tensorwise", rank=0,
                               relaymoe_fp8_experts="on")  # fmt: skip
    assert announce_fp8_experts(ns).startswith("[relaymoe] fp8 format hybrid, recipe tensorwise")
    assert capsys.readouterr().out.count("routed experts run fprop/dgrad/wgrad in fp8") == 1
    ns.rank = 3
    announce_fp8_experts(ns)
    assert capsys.readouterr().out == ""


def test_train_step_drops_the_fp8_weight_copies_around_each_step(mcore):
    """Patch 7: every ring layer's fp8 state is invalidated before and after the step (the
    optimizer writes the weights through ``.data``, which no version counter sees)."""
    import torch
    from megatron.training import training

    from relaymoe.megatron import patches

    events = []

    class State:
        def __init__(self, name):
            self.name = name

        def invalidate(self):
            events.append(self.name)

        def roles(self):  # no delayed-scaling histories to merge
            return {}

    class Layer(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.token_dispatcher = types.SimpleNamespace(fp8=State(name))

    def step(forward_step_func, data_iterator, model, optimizer):  # Megatron's order
        events.append("step")
        return "result"

    model = [torch.nn.Sequential(Layer("a"), Layer("b"), torch.nn.Linear(2, 2))]
    patched = training.train_step
    assert getattr(patched, patches.MARK)  # register() installed it
    training.train_step = step
    try:
        patches.patch_train_step()
        assert training.train_step("f", "it", model, "opt") == "result"
        assert events == ["a", "b", "step", "a", "b"]
        events.clear()
        training.train_step("f", "it", model=model, optimizer="opt")
        assert events == ["a", "b", "step", "a", "b"]
    finally:
        training.train_step = patched


def test_same_options_accepted_by_other_dispatchers(mcore):
    # the patch only judges ring configs
    _config(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0)


def test_refused_on_megatron_args(mcore):
    from relaymoe.megatron.validate import check_ring_args

    ns = types.SimpleNamespace(
        moe_token_dispatcher_type="ring",
        num_experts=8,
        expert_model_parallel_size=4,
        tensor_model_parallel_size=1,
        swiglu=True,
        add_bias_linear=False,
        moe_expert_capacity_factor=None,
    )
    check_ring_args(ns)
    ns.swiglu, ns.add_bias_linear = False, True  # Megatron's default experts: GELU with biases
    check_ring_args(ns)
    ns.moe_expert_capacity_factor = 1.25
    ns.swiglu, ns.activation_func_clamp_value = True, 7.0  # --bias-swiglu-fusion: Megatron's
    with pytest.raises(ValueError) as info:
        check_ring_args(ns)
    assert "moe_expert_capacity_factor=1.25" in str(info.value)
    assert "fused SwiGLU ignores the clamp; fix: --no-bias-swiglu-fusion" in str(info.value)
    ns.bias_swiglu_fusion = False
    ns.moe_expert_capacity_factor = None
    check_ring_args(ns)
    ns.moe_token_dispatcher_type = "alltoall"
    check_ring_args(ns)  # not ours to judge


def test_whole_step_graph_accepted_and_its_refusals(mcore):
    """``--cuda-graph-impl full_iteration`` runs the ring captured
    (``relaymoe/ring/hop_graphs.py``): accepted on a config and on the arguments; refused with
    the all-to-all mode (host-sized messages) and without an eager warm-up step (the ranks agree
    there)."""
    from relaymoe.megatron.validate import check_ring_args, ring_config_problems

    assert ring_config_problems(_config(cuda_graph_impl="full_iteration")) == []
    ns = types.SimpleNamespace(moe_token_dispatcher_type="ring", num_experts=8,
                               expert_model_parallel_size=2, swiglu=True, add_bias_linear=False,
                               cuda_graph_impl="full_iteration", cuda_graph_warmup_steps=2,
                               relaymoe_mode="auto")  # fmt: skip
    check_ring_args(ns)
    for field, value, message in (
        ("relaymoe_mode", "alltoall", "sizes its messages"),
        ("cuda_graph_warmup_steps", 0, "--cuda-graph-warmup-steps 1"),
    ):
        bad = types.SimpleNamespace(**{**vars(ns), field: value})
        with pytest.raises(ValueError, match=message):
            check_ring_args(bad)


@pytest.mark.parametrize(
    "modules", [["attn", "moe"], ["moe"], []], ids=["attn_moe", "moe", "layer"]
)
def test_per_layer_moe_graph_builds_for_the_ring_only(mcore, modules):
    """A per-layer CUDA graph over the ring's whole MoE layer builds (megatron-core's
    drop-and-pad assertion lifted for the ring only), the config keeps the ring dropless, and
    the dispatcher runs the capturable path; the same config for megatron-core's own alltoall
    still meets megatron-core's assertion."""
    from relaymoe.megatron.validate import ring_graph_capture

    cfg = _config(cuda_graph_impl="transformer_engine", cuda_graph_modules=list(modules),
                  cuda_graph_warmup_steps=2)  # fmt: skip
    assert (cfg.moe_expert_capacity_factor, cfg.moe_pad_expert_input_to_capacity) == (None, False)
    assert ring_graph_capture(cfg) == "per_layer"
    assert ring_graph_capture(_config()) is None
    assert ring_graph_capture(_config(cuda_graph_impl="full_iteration")) == "whole_step"
    assert ring_graph_capture(_config(cuda_graph_impl="local",
                                      cuda_graph_modules=["attn"])) is None  # fmt: skip
    if "moe" in modules:  # megatron-core asserts only where the scope names the MoE layer
        with pytest.raises(AssertionError, match="drop-padding"):
            _config(cuda_graph_impl="transformer_engine", cuda_graph_modules=list(modules),
                    moe_token_dispatcher_type="alltoall")  # fmt: skip
    with pytest.raises(ValueError, match="local per-layer graphs"):
        _config(cuda_graph_impl="local", cuda_graph_modules=list(modules),
                cuda_graph_warmup_steps=2)  # fmt: skip


def test_per_layer_moe_graph_refusals(mcore):
    """Under a per-layer MoE graph: part of the MoE layer, the all-to-all mode, Sinkhorn and no
    eager warm-up are refused by name, on the config and on the arguments."""
    from relaymoe.megatron.validate import check_ring_args

    ns = types.SimpleNamespace(moe_token_dispatcher_type="ring", num_experts=8,
                               expert_model_parallel_size=2, swiglu=True, add_bias_linear=False,
                               cuda_graph_impl="transformer_engine",
                               cuda_graph_modules=["attn", "moe"], cuda_graph_warmup_steps=2,
                               relaymoe_mode="auto",
                               moe_router_load_balancing_type="aux_loss")  # fmt: skip
    check_ring_args(ns)
    for field, value, message in (
        ("cuda_graph_modules", ["attn", "moe_router"], "part of the MoE layer"),
        ("cuda_graph_modules", ["moe_router", "moe_preprocess"], "--cuda-graph-modules attn moe"),
        ("relaymoe_mode", "alltoall", "sizes its messages on the host"),
        ("cuda_graph_warmup_steps", 0, "--cuda-graph-warmup-steps 1"),
        ("moe_router_load_balancing_type", "sinkhorn", "Sinkhorn"),
        ("cuda_graph_impl", "local", "transformer_engine --cuda-graph-modules attn moe"),
    ):
        bad = types.SimpleNamespace(**{**vars(ns), field: value})
        with pytest.raises(ValueError, match=message):
            check_ring_args(bad)
    with pytest.raises(ValueError, match="Sinkhorn"):
        check_ring_args(
            types.SimpleNamespace(
                **{
                    **vars(ns),
                    "cuda_graph_impl": "full_iteration",
                    "cuda_graph_modules": [],
                    "moe_router_load_balancing_type": "sinkhorn",
                }
            )
        )
    with pytest.raises(ValueError, match="part of the MoE layer"):
        _config(cuda_graph_impl="local", cuda_graph_modules=["moe_router"])


def test_recompute_plan_applied_once(mcore, monkeypatch, capsys):
    import relaymoe.planner as planner
    from relaymoe.megatron import patches

    class FakePlan:
        megatron_args = {
            "recompute_granularity": "selective",
            "recompute_modules": ["moe"],
            "recompute_method": None,
            "lr": 1.0,
        }

        def summary(self):
            return "fake plan"

    seen = {}

    def fake_plan(args, gpu_bytes=None, kernels=None):
        seen["kernels"] = kernels
        return FakePlan()

    monkeypatch.setattr(planner, "plan_from_megatron_args", fake_plan)
    ns = types.SimpleNamespace(
        rank=0, recompute_granularity=None, recompute_modules=None, recompute_method="block", lr=3.0
    )
    applied = patches.apply_recompute_plan(ns)
    # the plan is for the run's own kernel options (its hop slices), built once onto the args
    assert seen["kernels"] is ns.relaymoe_ring.kernels
    patches.apply_recompute_plan(ns)
    assert applied == {
        "recompute_granularity": "selective",
        "recompute_modules": ["moe"],
        "recompute_method": None,
    }
    assert (ns.recompute_granularity, ns.recompute_modules, ns.recompute_method, ns.lr) == (
        "selective",
        ["moe"],
        None,
        3.0,
    )
    assert capsys.readouterr().out.count("recompute planner: fake plan") == 1


# ------------------------------------------------------------------ small pieces
def test_routing_map_to_topk():
    pytest.importorskip("megatron.core")
    from relaymoe.megatron.dispatcher import routing_map_to_topk

    g = torch.Generator().manual_seed(0)
    T, E, K = 9, 6, 3
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    probs = (torch.rand(T, E, generator=g) * rmap).requires_grad_(True)
    rmap[4] = False  # a row with no selection (masked token): its pairs carry probability 0
    rmap[5, idx[5, 0]] = False  # a row with fewer than K
    got_idx, got_p = routing_map_to_topk(rmap, probs, K)
    for t in range(T):
        chosen = {int(e) for e, p in zip(got_idx[t], got_p[t], strict=True) if p != 0}
        assert chosen == {int(e) for e in rmap[t].nonzero().flatten()}
        assert len(set(got_idx[t].tolist())) == K  # distinct ids
    got_p.sum().backward()
    assert torch.equal(probs.grad, rmap.to(probs.dtype))  # gradient only on selected entries
    with pytest.raises(ValueError, match="moe_router_topk"):
        routing_map_to_topk(rmap, probs, E + 1)


class _Lin(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = torch.nn.Parameter(w)
        self.bias = None


class _Expert(torch.nn.Module):
    def __init__(self, w1, w2):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = _Lin(w1), _Lin(w2)


class _Seq(torch.nn.Module):  # SequentialMLP's layout
    def __init__(self, w13, w2):
        super().__init__()
        self.local_experts = torch.nn.ModuleList(
            _Expert(a.clone(), b.clone()) for a, b in zip(w13, w2, strict=True)
        )


@pytest.mark.parametrize("layout", ["separate", "contiguous", "ddp-reversed"])
def test_expert_weights_layout_and_rehoming(layout):
    """The adapter hands the parameters themselves to the ring; the layout tells whether a ring
    pass views them in place. Re-homing keeps values, objects and names."""
    from relaymoe.megatron import expert_weights as ew

    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(3, 8, 5, generator=g), torch.randn(3, 5, 4, generator=g)
    m = _Seq(w13, w2)  # separate tensors per expert, as Megatron allocates them
    names = [n for n, _ in m.named_parameters()]
    params = list(m.parameters())
    fc1, fc2 = ew.expert_param_lists(m)
    assert ew.expert_weights_layout(m) == (None, None)
    if layout == "contiguous":
        ew.make_expert_weights_contiguous(m)
        assert ew.expert_weights_layout(m) == ("forward", "forward")
    elif layout == "ddp-reversed":  # DDP's buffer: reverse registration order, fc1s then fc2s
        ordered = (fc1 + fc2)[::-1]
        buf = torch.empty(sum(p.numel() for p in ordered))
        at = 0
        with torch.no_grad():
            for p in ordered:
                view = buf[at : at + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
                at += p.numel()
        assert ew.expert_weights_layout(m) == ("reversed", "reversed")
        ew.make_expert_weights_contiguous(m)  # already back to back: left where DDP put it
        assert fc1[0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert [n for n, _ in m.named_parameters()] == names
    assert all(a is b for a, b in zip(m.parameters(), params, strict=True))
    for j in range(3):
        assert torch.equal(fc1[j], w13[j]) and torch.equal(fc2[j], w2[j])


def test_unknown_experts_module_refused():
    from relaymoe.megatron.expert_weights import expert_param_lists

    with pytest.raises(NotImplementedError, match="SequentialMLP"):
        expert_param_lists(torch.nn.Linear(2, 2))


def test_pretrain_uses_the_wheels_prebuilt_dataset_helpers(mcore, monkeypatch):
    """The wheel has helpers_cpp but no Makefile: Megatron's `make` would fail and exit."""
    import subprocess

    from megatron.core.datasets import utils as ds_utils

    from relaymoe.megatron.pretrain import use_prebuilt_dataset_helpers

    monkeypatch.setattr(ds_utils, "compile_helpers", ds_utils.compile_helpers)

    def no_make(*args, **kwargs):
        raise AssertionError(f"make was run: {args}")

    monkeypatch.setattr(subprocess, "run", no_make)
    assert use_prebuilt_dataset_helpers() is True
    ds_utils.compile_helpers()  # what megatron.training.initialize calls on rank 0
    assert use_prebuilt_dataset_helpers() is True  # idempotent


def test_launch_runs_the_script_registered(tmp_path):
    """``python -m relaymoe.megatron.launch SCRIPT ARGS``: the script runs as ``__main__`` with its
    own argv, its folder importable, relaymoe registered and (wheel install) no ``make`` step."""
    import subprocess
    import sys

    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    (tmp_path / "train.py").write_text(
        "import sys, sibling\n"
        "from megatron.core.datasets import utils as ds_utils\n"
        "import relaymoe.megatron as rm\n"
        "assert __name__ == '__main__'\n"
        "assert sys.argv[1:] == ['--moe-token-dispatcher-type', 'ring'], sys.argv\n"
        "assert rm.is_registered(), 'not registered'\n"
        "helpers_ok = getattr(ds_utils.compile_helpers, '__relaymoe_patched__', False)\n"
        "print('RAN', sibling.VALUE, helpers_ok)\n"
        "sys.exit(3)\n"
    )
    p = subprocess.run(
        [sys.executable, "-m", "relaymoe.megatron.launch", str(tmp_path / "train.py"),
         "--moe-token-dispatcher-type", "ring"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert p.returncode == 3 and "RAN 7 True" in p.stdout, p.stdout + p.stderr[-3000:]


def test_pretrain_refuses_the_ep_overlap_schedule_plan_with_the_fix(mcore):
    from relaymoe.megatron.pretrain import forward_step

    with pytest.raises(NotImplementedError, match="remove that flag"):
        forward_step(iter(()), torch.nn.Module(), return_schedule_plan=True)


# ------------------------------------------------------------------ checkpoint layer specs
def test_impl_mismatch_named_for_moe_checkpoints():
    from relaymoe.megatron.checkpoint_compat import impl_mismatch

    ns = types.SimpleNamespace
    te, local = (
        ns(num_experts=8, transformer_impl="transformer_engine"),
        ns(num_experts=8, transformer_impl="local"),
    )
    why = impl_mismatch(local, te)
    assert "saved with --transformer-impl local" in why and "builds --transformer-impl tr" in why
    assert "pre_mlp_layernorm.weight" in why and "fix: resume with --transformer-impl local" in why
    assert "fix: resume with --transformer-impl transformer_engine" in impl_mismatch(te, local)
    assert impl_mismatch(te, te) is None and impl_mismatch(local, local) is None
    dense = ns(num_experts=None, transformer_impl="local")  # dense models map every key
    assert impl_mismatch(dense, ns(num_experts=None, transformer_impl="transformer_engine")) is None
    assert impl_mismatch(ns(num_experts=8), te) is None  # Megatron's default impl is TE
    assert impl_mismatch(None, te) is None


def test_checkpoint_load_refuses_other_impl_before_any_tensor(mcore, monkeypatch):
    """The patched ``_load_base_checkpoint`` reads the common state (``rank0=True``) and raises a
    ValueError naming both implementations; other calls pass through unchanged."""
    from megatron.training import checkpointing

    from relaymoe.megatron import patches

    saved = types.SimpleNamespace(num_experts=4, transformer_impl="local")
    calls = []

    def fake_load(load_dir, args, rank0=False, sharded_state_dict=None, **kw):
        calls.append(rank0)
        return {"args": saved, "iteration": 10}, "name", False, "global"

    monkeypatch.setattr(checkpointing, "_load_base_checkpoint", fake_load)
    patches.patch_checkpoint_loading()
    wrapped = checkpointing._load_base_checkpoint
    assert wrapped is not fake_load and getattr(wrapped, patches.MARK)
    args = types.SimpleNamespace(num_experts=4, transformer_impl="transformer_engine")
    with pytest.raises(ValueError, match=r"cannot load the checkpoint in /ck: .*saved with "):
        wrapped("/ck", args, rank0=True)
    with pytest.raises(ValueError, match="--transformer-impl local"):
        wrapped("/ck", args, True)  # rank0 given positionally
    assert wrapped("/ck", args, rank0=False)[0]["iteration"] == 10  # the full load: not judged
    args.transformer_impl = "local"
    assert wrapped("/ck", args, rank0=True)[0]["iteration"] == 10
    assert calls == [True, True, False, True]
    patches.patch_checkpoint_loading()  # idempotent
    assert checkpointing._load_base_checkpoint is wrapped


def _te_like_state(prefix: str = "decoder."):
    """A model's sharded state as a TE model builds it: tensors and ``_extra_state`` objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    w = ShardedTensor.from_rank_offsets(prefix + "final_layernorm.weight", torch.ones(4))
    qkv = ShardedTensor.from_rank_offsets(prefix + "layers.linear_qkv.weight", torch.ones(2, 4))
    return {
        "model": {
            "decoder.final_layernorm.weight": w,
            "decoder.final_layernorm._extra_state": ShardedObject(
                prefix + "final_layernorm._extra_state", torch.empty(0), (1,), (0,)),
            "decoder.layers.0.linear_qkv.weight": qkv,
            "decoder.layers.0.linear_qkv._extra_state": ShardedObject(
                prefix + "layers.linear_qkv._extra_state", torch.empty(0), (2,), (0,)),
            "decoder.layers.0.core_attention": {"_extra_state": ShardedObject(
                prefix + "layers.core_attention._extra_state", None, (2,), (0,))},
        },
        "optimizer": {"_extra_state": "not a model entry"},
    }  # fmt: skip


def test_absent_extra_state_is_left_out_and_nothing_else(mcore):
    """Of a TE model's sharded state, exactly the ``_extra_state`` objects the checkpoint lacks
    leave the load; tensors (present or not), extra state the checkpoint has, and the other
    top-level parts stay."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from relaymoe.megatron.checkpoint_compat import drop_absent_extra_state

    sd = _te_like_state()
    saved = {"decoder.final_layernorm.weight", "decoder.layers.core_attention._extra_state"}
    dropped = drop_absent_extra_state(sd, saved)
    assert dropped == ["decoder.final_layernorm._extra_state",
                       "decoder.layers.linear_qkv._extra_state"]  # fmt: skip
    left = sorted(x.key for x in nested_values(sd["model"]))
    assert left == ["decoder.final_layernorm.weight", "decoder.layers.core_attention._extra_state",
                    "decoder.layers.linear_qkv.weight"]  # fmt: skip
    assert sd["optimizer"] == {"_extra_state": "not a model entry"}
    assert drop_absent_extra_state(sd, saved) == []  # nothing left to drop


def test_converted_checkpoint_loads_without_its_absent_extra_state(mcore, monkeypatch, tmp_path):
    """After the common state of a convert-hf checkpoint (its saved arguments marked) is read,
    the full load from that folder gets the model's sharded state without the TE extra state
    the checkpoint lacks; a checkpoint not marked, or a load from another folder, is untouched."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.training import checkpointing

    from relaymoe.megatron import patches
    from relaymoe.megatron.checkpoint_compat import CONVERTED_MARK

    ck, other = tmp_path / "ck", tmp_path / "other"
    for d in (ck, other):
        (d / "release").mkdir(parents=True)
    marked = types.SimpleNamespace(num_experts=4, transformer_impl="transformer_engine",
                                   **{CONVERTED_MARK: True})  # fmt: skip
    plain = types.SimpleNamespace(num_experts=4, transformer_impl="transformer_engine")
    seen = {}

    def fake_load(load_dir, args, rank0=False, sharded_state_dict=None, **kw):
        if not rank0:
            seen[load_dir] = sorted(sharded_state_dict["model"])
        return {"args": marked if load_dir == str(ck) else plain}, "name", True, "global"

    monkeypatch.setattr(checkpointing, "_load_base_checkpoint", fake_load)
    monkeypatch.setattr(serialization, "load_sharded_metadata",
                        lambda d: {"decoder.final_layernorm.weight": None})  # fmt: skip
    patches.patch_checkpoint_loading()
    wrapped = checkpointing._load_base_checkpoint
    args = types.SimpleNamespace(num_experts=4, transformer_impl="transformer_engine", rank=0)
    full = sorted(_te_like_state()["model"])
    for d in (ck, other):
        wrapped(str(d), args, rank0=True)
        wrapped(str(d), args, rank0=False, sharded_state_dict=_te_like_state())
    assert seen[str(other)] == full  # not marked: the load is Megatron's own
    assert seen[str(ck)] == ["decoder.final_layernorm.weight",
                             "decoder.layers.0.linear_qkv.weight"], seen  # fmt: skip
