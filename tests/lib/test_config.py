"""Config schema, YAML loading, validation and Megatron flag rendering."""

import os
import textwrap

import pytest

from relaymoe.config import (
    CONFIG_DIR,
    config_from_dict,
    load_config,
    resolve_config_path,
    to_megatron_args,
)
from tests.fixtures import run_python, small_config_dict

ALL_CONFIGS = sorted(str(p.relative_to(CONFIG_DIR))[:-5] for p in CONFIG_DIR.rglob("*.yaml"))


def test_all_configs_load_and_render():
    assert {"qwen3_30b_a3b", "qwen3_5_35b_a3b", "qwen2_57b_a14b", "tiny_qwen3"} <= set(ALL_CONFIGS)
    assert sum(n.startswith("table3/") for n in ALL_CONFIGS) >= 8
    for name in ALL_CONFIGS:
        cfg = load_config(name)
        assert cfg.name == name
        args = to_megatron_args(cfg)
        assert all(isinstance(a, str) for a in args)
        assert args[args.index("--num-layers") + 1] == str(cfg.model.num_layers)


def test_qwen3_30b_values_and_flags():
    cfg = load_config("qwen3_30b_a3b")
    m, p = cfg.model, cfg.parallel
    assert (m.num_layers, m.hidden_size, m.num_experts, m.moe_router_topk) == (48, 2048, 128, 8)
    assert (m.moe_ffn_hidden_size, m.query_groups, m.head_dim, m.vocab_size) == (
        768,
        4,
        128,
        151936,
    )
    assert (p.tp, p.cp, p.pp, p.ep, p.etp, p.world_size) == (2, 4, 4, 8, 1, 32)
    s = " ".join(to_megatron_args(cfg))
    for frag in (
        "--num-layers 48",
        "--hidden-size 2048",
        "--num-experts 128",
        "--moe-router-topk 8",
        "--moe-ffn-hidden-size 768",
        "--group-query-attention --num-query-groups 4",
        "--tensor-model-parallel-size 2",
        "--context-parallel-size 4",
        "--pipeline-model-parallel-size 4",
        "--expert-model-parallel-size 8",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--bf16",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    ):
        assert frag in s, frag


def test_qwen35_hybrid_pattern():
    m = load_config("qwen3_5_35b_a3b").model
    pat = m.attention_layer_pattern
    assert len(pat) == 40 and sum(pat) == 10
    assert [i for i, x in enumerate(pat) if x] == list(range(3, 40, 4))
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size) == (
        256,
        512,
        512,
    )


def test_bare_name_and_path_resolve(tmp_path):
    assert resolve_config_path("qwen3_30b_a3b") == CONFIG_DIR / "qwen3_30b_a3b.yaml"
    assert resolve_config_path("table3/e64.yaml") == CONFIG_DIR / "table3" / "e64.yaml"
    assert load_config(CONFIG_DIR / "tiny_qwen3.yaml").name == "tiny_qwen3"
    with pytest.raises(ValueError, match="not found.*known names"):
        load_config("no_such_model")


def test_unknown_key_names_it_and_known_ones():
    d = small_config_dict()
    d["model"]["num_expertz"] = 8
    with pytest.raises(ValueError, match=r"unknown key model\.'num_expertz'.*num_experts"):
        config_from_dict(d)
    d = small_config_dict()
    d["parallel"]["pipeline"] = 2
    with pytest.raises(ValueError, match=r"unknown key parallel\.'pipeline'.*known keys.*tp"):
        config_from_dict(d)
    d = small_config_dict()
    d["optimizer"] = {}
    with pytest.raises(ValueError, match="unknown config section"):
        config_from_dict(d)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (("training",), "config has no 'training' section; add it (required: model, parallel, "
         "training; optional: relaymoe)"),
        (("model", "training"), "config has no 'model', 'training' sections; add them "
         "(required: model, parallel, training; optional: relaymoe)"),
    ],
)  # fmt: skip
def test_a_missing_section_is_named_and_the_optional_one_is_not_required(drop, message):
    d = small_config_dict()
    for sec in drop:
        del d[sec]
    with pytest.raises(ValueError) as info:
        config_from_dict(d)
    assert str(info.value) == message
    d = small_config_dict()
    d.pop("relaymoe", None)  # optional
    assert config_from_dict(d).relaymoe is not None


def test_mlp_activation_fields_render_megatron_flags():
    """swiglu (the default), squared_relu, or neither (GELU, not gated); not both."""
    gelu, squared = load_config("tiny_qwen3_gelu"), load_config("tiny_qwen3_squared_relu")
    tiny = load_config("tiny_qwen3")
    for cfg, has in ((tiny, {"--swiglu"}), (gelu, set()), (squared, {"--squared-relu"})):
        args = set(to_megatron_args(cfg))
        assert args & {"--swiglu", "--squared-relu"} == has, cfg.name
        assert "--disable-bias-linear" in args
    assert gelu.replace(model={"swiglu": True}).to_dict() == tiny.to_dict()  # all but that
    d = small_config_dict()
    d["model"]["squared_relu"] = True
    with pytest.raises(ValueError, match="model.swiglu and model.squared_relu are both true"):
        config_from_dict(d)
    d["model"]["swiglu"] = False
    assert "--squared-relu" in to_megatron_args(config_from_dict(d))


def test_alias_num_moe_experts():
    d = small_config_dict()
    d["model"]["num_moe_experts"] = d["model"].pop("num_experts")
    assert config_from_dict(d).model.num_experts == 4


@pytest.mark.parametrize(
    "section,key,value,pattern",
    [
        ("parallel", "ep", 3, "ep=3 does not divide model.num_experts=4"),
        ("parallel", "tp", 3, "tp=3 does not divide model.num_attention_heads"),
        ("parallel", "tp", 4, "does not divide model.num_query_groups=2"),
        ("parallel", "pp", 3, "num_layers=2 is not divisible by pp"),
        ("parallel", "ep", 2, "ep\\*etp=2 does not divide the tp\\*cp\\*dp=1"),
        ("training", "seq_length", 502, None),
        ("model", "moe_router_topk", 5, "exceeds model.num_experts"),
        ("model", "num_layers", 0, "positive integer"),
        ("model", "hidden_size", "big", "must be an integer"),
        ("training", "precision", "fp8", "known: 'bf16'"),
    ],
)
def test_bad_values(section, key, value, pattern):
    d = small_config_dict()
    d[section][key] = value
    if key == "ep" and value == 3:
        d["parallel"]["dp"] = 3  # so that only the expert count is the problem
    if section == "training" and key == "seq_length":
        d["parallel"].update(cp=2, dp=2)  # needs seq % (2*cp) == 0
        pattern = "seq_length=502 is not divisible by 2\\*cp\\*tp=4"
    with pytest.raises(ValueError, match=pattern):
        config_from_dict(d)


def test_replace_revalidates():
    cfg = load_config("tiny_qwen3")
    c2 = cfg.replace(parallel={"ep": 2, "dp": 2})
    assert (c2.parallel.ep, c2.parallel.world_size) == (2, 2)
    assert cfg.parallel.ep == 1  # frozen original untouched
    with pytest.raises(ValueError, match="does not divide"):
        cfg.replace(parallel={"ep": 4})
    with pytest.raises(ValueError, match="unknown key"):
        cfg.replace(training={"seqlen": 4})


def test_flags_parse_with_megatron(tmp_path):
    """Every rendered flag is accepted by megatron-core's own argument parser, with our values."""
    pytest.importorskip("megatron.training.arguments")
    code = textwrap.dedent(
        """
        import argparse, json, sys, warnings
        warnings.filterwarnings("ignore")
        from megatron.training.arguments import add_megatron_arguments
        from relaymoe.config import load_config, to_megatron_args
        p = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        out = {}
        for name in sys.argv[1:]:
            cfg = load_config(name)
            a = p.parse_args(to_megatron_args(cfg, dispatcher="alltoall"))
            m = cfg.model
            assert a.num_experts == m.num_experts and a.moe_ffn_hidden_size == m.moe_ffn_hidden_size
            assert a.num_query_groups == m.query_groups and a.kv_channels == m.kv_channels
            assert a.expert_model_parallel_size == cfg.parallel.ep
            assert a.linear_attention_freq == m.linear_attention_freq
            out[name] = a.recompute_granularity
        print(json.dumps(out))
        """
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    names = ["qwen3_30b_a3b", "qwen3_5_35b_a3b", "qwen2_57b_a14b", "tiny_qwen3", "table3/e64"]
    r = run_python(["-c", code, *names], env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert '"qwen3_30b_a3b": "full"' in r.stdout


def test_recompute_fields_validated():
    d = small_config_dict()
    d["training"].update(recompute_granularity="selective", recompute_modules=["core_attn", "x"])
    with pytest.raises(ValueError, match=r"unknown module\(s\) \['x'\]"):
        config_from_dict(d)
    d["training"].update(recompute_granularity="full", recompute_modules=None)
    with pytest.raises(ValueError, match="needs 'uniform' or 'block'"):
        config_from_dict(d)
    d["training"].update(recompute_method="block", recompute_num_layers=2)
    assert config_from_dict(d).training.recompute_num_layers == 2


def test_dispatcher_flags():
    cfg = load_config("qwen3_30b_a3b")
    s = " ".join(to_megatron_args(cfg))
    assert "--moe-token-dispatcher-type ring --relaymoe-mode auto" in s
    s = " ".join(to_megatron_args(cfg, dispatcher="alltoall"))
    assert "--moe-token-dispatcher-type alltoall" in s and "relaymoe" not in s
    assert "--attention-dropout 0.0 --hidden-dropout 0.0" in s
    with pytest.raises(ValueError, match="dispatcher='x'"):
        to_megatron_args(cfg, dispatcher="x")


def test_normalization_impl_field():
    d = small_config_dict()
    assert config_from_dict(d).training.normalization_impl == "fused"  # TE/apex by default
    d["training"]["normalization_impl"] = "torch"
    cfg = config_from_dict(d)
    assert cfg.training.normalization_impl == "torch"
    assert cfg.to_dict()["training"]["normalization_impl"] == "torch"
    # a memory-model setting, not a Megatron flag
    s = " ".join(to_megatron_args(cfg))
    assert "normalization-impl" not in s and "torch" not in s
    assert to_megatron_args(cfg) == to_megatron_args(
        cfg.replace(training={"normalization_impl": "fused"})
    )
    d["training"]["normalization_impl"] = "apex"
    with pytest.raises(ValueError, match=r"normalization_impl='apex'; known: 'fused', 'torch'"):
        config_from_dict(d)
    d["training"].pop("normalization_impl")
    d["training"]["normalisation_impl"] = "torch"
    with pytest.raises(
        ValueError, match=r"unknown key training\.'normalisation_impl'.*normalization_impl"
    ):
        config_from_dict(d)
    # megatron-core's torch norm refuses sequence parallelism, which MoE needs at tp > 1
    d = small_config_dict()
    d["parallel"].update(tp=2, sequence_parallel=True)
    d["training"]["normalization_impl"] = "torch"
    with pytest.raises(ValueError, match="normalization_impl='torch' with parallel.tp=2"):
        config_from_dict(d)


def test_fused_loss_field_round_trip_and_flag():
    d = small_config_dict()
    cfg = config_from_dict(d)
    assert cfg.relaymoe.fused_loss is False
    assert "--relaymoe-fused-loss" not in to_megatron_args(cfg)
    d["relaymoe"] = {"fused_loss": True}
    on = config_from_dict(d)
    assert on.relaymoe.fused_loss is True and on.to_dict()["relaymoe"]["fused_loss"] is True
    assert config_from_dict(on.to_dict()) == on  # round trip through the dict form
    # every dispatcher: the flag is about the output layer, not the MoE layer
    for disp in ("ring", "alltoall"):
        args = to_megatron_args(on, dispatcher=disp)
        assert args.count("--relaymoe-fused-loss") == 1, disp
    assert on.replace(relaymoe={"fused_loss": False}) == cfg


def test_fused_loss_from_yaml_and_bad_values(tmp_path):
    base = (CONFIG_DIR / "tiny_qwen3.yaml").read_text()
    assert "fused_loss" not in base
    p = tmp_path / "f.yaml"
    p.write_text(base.replace("\nrelaymoe:\n", "\nrelaymoe:\n  fused_loss: true\n", 1))
    cfg = load_config(p)
    assert cfg.relaymoe.fused_loss is True
    assert (
        cfg.replace(relaymoe={"fused_loss": False}).to_dict() == load_config("tiny_qwen3").to_dict()
    )
    d = small_config_dict()
    d["relaymoe"] = {"fused_loss": "yes"}
    with pytest.raises(ValueError, match=r"relaymoe.fused_loss='yes' must be true or false"):
        config_from_dict(d)
    d["relaymoe"] = {"fused_los": True}
    with pytest.raises(ValueError, match=r"unknown key relaymoe.'fused_los'.*fused_loss"):
        config_from_dict(d)
    from relaymoe.config import RelayMoEConfig

    with pytest.raises(ValueError, match=r"relaymoe.fused_loss=1 must be true or false"):
        RelayMoEConfig(fused_loss=1)


def test_gpus_per_node_field():
    """parallel.gpus_per_node (issue #18): None is one node; an EP group across nodes must fill
    whole nodes, and the message names the value, the limit and the fix."""
    cfg = load_config("qwen3_30b_a3b")  # ep=8, etp=1
    assert cfg.parallel.gpus_per_node is None
    assert cfg.replace(parallel={"gpus_per_node": 4}).parallel.gpus_per_node == 4
    assert cfg.replace(parallel={"gpus_per_node": 16}).parallel.gpus_per_node == 16  # fits one
    with pytest.raises(ValueError, match=r"gpus_per_node=3.*ep\*etp=8.*multiple of 3"):
        cfg.replace(parallel={"gpus_per_node": 3})
    with pytest.raises(ValueError, match="parallel.gpus_per_node=0 must be a positive integer"):
        cfg.replace(parallel={"gpus_per_node": 0})
    with pytest.raises(ValueError, match="must be an integer"):
        cfg.replace(parallel={"gpus_per_node": "8"})
    four = cfg.replace(parallel={"gpus_per_node": 4})
    assert " --relaymoe-gpus-per-node 4" in " ".join(to_megatron_args(four, dispatcher="ring"))
    assert "gpus-per-node" not in " ".join(to_megatron_args(four, dispatcher="alltoall"))
    assert "gpus-per-node" not in " ".join(to_megatron_args(cfg, dispatcher="ring"))


def test_configs_ship_in_the_package():
    """Bare config names resolve in an installed wheel: the YAMLs live in the package and its
    package data covers every one of them; pyyaml is a dependency, not a dev extra."""
    import tomllib
    from pathlib import Path

    import relaymoe
    from relaymoe.config import CONFIG_DIR

    pkg = Path(relaymoe.__file__).resolve().parent
    assert CONFIG_DIR == pkg / "configs"
    meta = tomllib.loads((pkg.parent / "pyproject.toml").read_text())
    globs = meta["tool"]["setuptools"]["package-data"]["relaymoe"]
    shipped = {p for g in globs for p in pkg.glob(g)}
    yamls = set(CONFIG_DIR.rglob("*.yaml"))
    assert len(yamls) > 10 and yamls <= shipped, sorted(map(str, yamls - shipped))
    assert any(d.lower().startswith("pyyaml") for d in meta["project"]["dependencies"])


def test_every_field_of_every_yaml_type_loads_or_names_the_value():
    """A config value of any YAML type (int, float, str, bool, list, mapping, null) either loads
    or raises ValueError naming the key (issue #32: ``recompute_modules: 5`` was a TypeError)."""
    from dataclasses import fields

    from relaymoe.config.schema import SECTIONS

    values = [0, -1, 3, 2.5, "x", True, [1], ["a"], [], {"a": 1}, None]
    for sec, cls in SECTIONS.items():
        for f in fields(cls):
            for v in values:
                try:
                    config_from_dict(small_config_dict(**{sec: {f.name: v}}))
                except ValueError as e:
                    assert "Traceback" not in str(e)


def test_recompute_modules_and_layer_patterns_of_the_wrong_type(tmp_path):
    from relaymoe.cli import main

    d = small_config_dict(training={"recompute_granularity": "selective", "recompute_modules": 5})
    with pytest.raises(ValueError, match=r"training.recompute_modules=5 must be a list of names"):
        config_from_dict(d)
    d["training"]["recompute_modules"] = ["core_attn", 3]
    with pytest.raises(ValueError, match=r"recompute_modules=\['core_attn', 3\].*holds 3"):
        config_from_dict(d)
    d["training"]["recompute_modules"] = "core_attn"  # one name: a list of one
    assert config_from_dict(d).training.recompute_modules == ("core_attn",)
    for bad in (2.5, "abc", [1, "x"]):
        with pytest.raises(ValueError, match=r"model.moe_layer_freq="):
            config_from_dict(small_config_dict(model={"moe_layer_freq": bad}))
    import yaml

    path = tmp_path / "bad.yaml"
    bad = small_config_dict(training={"recompute_granularity": "selective",
                                      "recompute_modules": 5})  # fmt: skip
    path.write_text(yaml.safe_dump(bad))
    assert main(["flags", "--config", str(path)]) == 2  # one line on stderr, no traceback


def test_a_sequence_beyond_max_position_embeddings():
    """RoPE: the flags raise --max-position-embeddings to the sequence (Megatron asserts it is
    at least seq_length) and a note says so; a learned position table is refused."""
    from relaymoe.config import megatron_notes

    cfg = load_config("qwen3_30b_a3b")
    assert "--max-position-embeddings 40960" in " ".join(to_megatron_args(cfg))
    assert megatron_notes(cfg) == []
    long = cfg.replace(training={"seq_length": 131072})
    assert "--max-position-embeddings 131072" in " ".join(to_megatron_args(long))
    (note,) = megatron_notes(long)
    assert "seq_length=131072 exceeds model.max_position_embeddings=40960" in note
    learned = cfg.replace(model={"position_embedding_type": "learned_absolute"})
    with pytest.raises(ValueError, match="rows of the learned position table"):
        learned.replace(training={"seq_length": 131072})
