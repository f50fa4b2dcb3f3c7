"""`relaymoe plan`: JSON keys, rich output, and one clear message per bad input."""

import json
import os
import subprocess
import sys

from relaymoe.cli import DEFAULT_CONFIG, main
from relaymoe.config import CONFIG_DIR, load_config
from relaymoe.planner import plan


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_keys(capsys):
    rc, out, err = run(capsys, "plan", "--json")
    assert rc == 0, err
    d = json.loads(out)
    # the plan's fields (test_planner names them), every one printed
    want = plan(load_config(DEFAULT_CONFIG), "h100-80gb").to_dict()
    assert set(d) == set(want), set(d) ^ set(want)
    assert set(d["moe_peak_bytes"]) >= {"alltoall", "ring"}
    three = {"alltoall", "ring", "ring_fused_loss"}
    assert set(d["max_seq_length"]) >= three and set(d["max_micro_batch_size"]) >= three
    # issue #14's target: ring + fused loss >= 1.8x alltoall's longest sequence (H100 80 GB)
    seq = d["max_seq_length"]
    assert seq["ring_fused_loss"] >= 1.8 * seq["alltoall"], seq
    assert d["chosen"] == "ring" and "--relaymoe-fused-loss" not in d["megatron_args"]
    assert d["config_name"] == "qwen3_30b_a3b" and d["world_size"] == 32
    assert d["per_hop_bytes"]["expert"]["total"] > 0 and d["per_hop_bytes"]["token"]["total"] > 0


def test_overrides_and_gpu(capsys):
    rc, out, _ = run(
        capsys,
        "plan",
        "--config",
        "tiny_qwen3",
        "--gpu",
        "24GiB",
        "--ep",
        "2",
        "--dp",
        "2",
        "--mbs",
        "2",
        "--seq",
        "1024",
        "--json",
    )
    assert rc == 0
    d = json.loads(out)
    assert d["gpu_bytes"] == 24 * 2**30 and d["world_size"] == 2
    flags = " ".join(d["megatron_args"])
    assert "--expert-model-parallel-size 2" in flags and "--seq-length 1024" in flags


def test_rich_table(capsys):
    rc, out, _ = run(
        capsys, "plan", "--config", "table3/k4", "--seq", "16384", "--gpu", "h100-64gb"
    )
    assert rc == 0
    assert "alltoall" in out and "ring" in out and "Megatron flags" in out


def test_rich_capacity_lines(capsys):
    """The longest sequence and micro-batch, one line each for alltoall, ring, ring + fused."""
    rc, out, err = run(
        capsys, "plan", "--config", "configs/qwen3_30b_a3b.yaml", "--gpu", "h100-80gb"
    )
    assert rc == 0, err
    rc, js, _ = run(capsys, "plan", "--json")
    d = json.loads(js)
    lines = {}
    for ln in out.splitlines():
        head = ln.split("max seq length")[0].strip()
        if "max seq length" in ln and head:
            lines[head] = ln
    assert {"alltoall", "ring", "ring + fused loss"} <= set(lines), out
    for label, v in (
        ("alltoall", "alltoall"),
        ("ring", "ring"),
        ("ring + fused loss", "ring_fused_loss"),
    ):
        ln = lines[label]
        assert f"max seq length {d['max_seq_length'][v]:>8}" in ln, ln
        assert f"max micro-batch {d['max_micro_batch_size'][v]:>4}" in ln, ln
    assert "binds: activations_retained" in lines["ring + fused loss"]
    assert "binds: logits_loss" in lines["alltoall"]
    # the alltoall mode runs on the group's collectives, a ring mode on its transport
    assert d["routing_mode"] == "alltoall" and "alltoall over NCCL collectives" in out
    rc, out, _ = run(capsys, "plan", "--mode", "token")
    assert rc == 0 and "token over copy_engine" in out


def test_gradient_accumulation_fusion_switch(capsys):
    """``--no-gradient-accumulation-fusion`` (Megatron's flag, rendered in the flags): the ring's
    experts at EP 1 keep their weight-gradient buffer, so the ring's longest sequence shrinks;
    the default (fusion on) renders no flag."""
    base = ("plan", "--config", "qwen3_slice_v152k", "--ep", "1", "--dp", "1", "--mbs", "1",
            "--json")  # fmt: skip
    rc, out, _ = run(capsys, *base)
    on = json.loads(out)
    rc_off, out, _ = run(capsys, *base, "--no-gradient-accumulation-fusion")
    off = json.loads(out)
    assert rc == rc_off == 0
    assert "--no-gradient-accumulation-fusion" in off["megatron_args"]
    assert "--no-gradient-accumulation-fusion" not in on["megatron_args"]
    seq_on, seq_off = on["max_seq_length"], off["max_seq_length"]
    assert seq_on["ring_fused_loss"] > seq_off["ring_fused_loss"]
    assert seq_on["alltoall_fused_loss"] == seq_off["alltoall_fused_loss"]
    rc, out, _ = run(capsys, *base, "--gradient-accumulation-fusion")
    assert json.loads(out)["max_seq_length"] == seq_on


def test_fused_loss_switch(capsys):
    rc, out, _ = run(capsys, "plan", "--fused-loss", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["chosen"] == "ring_fused_loss" and d["fused_loss"] is True
    assert "--relaymoe-fused-loss" in d["megatron_args"]
    assert d["recompute_plan"] == d["recompute_plans"]["ring_fused_loss"]
    rc, out, _ = run(capsys, "plan", "--fused-loss", "--dispatcher", "alltoall", "--json")
    d = json.loads(out)
    assert d["chosen"] == "alltoall_fused_loss" and "--relaymoe-fused-loss" in d["megatron_args"]
    rc, out, _ = run(capsys, "plan", "--no-fused-loss", "--json")
    assert json.loads(out)["chosen"] == "ring"
    rc, out, _ = run(capsys, "plan", "--fused-loss")
    assert rc == 0 and "Megatron flags (ring + fused loss)" in out


def test_bad_inputs(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        open(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_qwen3.yaml"))
        .read()
        .replace("num_layers: 4", "num_layers: 4\n  num_layerz: 4")
    )
    cases = [
        (["--config", str(bad)], "unknown key model.'num_layerz'"),
        (["--tp", "3"], "does not divide"),
        (["--ep", "3"], "does not divide"),
        (["--config", "qwen2_57b_a14b", "--pp", "1", "--gpu", "h100-64gb"], "does not fit"),
        (["--gpu", "banana"], "not a preset"),
        (["--config", "nope"], "not found"),
    ]
    for argv, msg in cases:
        rc, out, err = run(capsys, "plan", *argv)
        assert rc == 2 and msg in err and "Traceback" not in err, (argv, err)
        assert err.count("\n") == 1  # one message


def test_python_dash_m():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        [sys.executable, "-m", "relaymoe", "plan", "--tp", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "tp 3" in r.stderr


def test_recompute_table_says_none_needed_and_fits_80_columns(capsys, monkeypatch):
    """No "None | None | None" where nothing is recomputed, the Megatron setting where layers
    are, and no header or cell cut (rich's "…") at 80 columns."""
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, err = run(capsys, "plan")  # qwen3_30b_a3b at 32k: every layer kept
    assert rc == 0, err
    table = out.split("Recompute plan")[1].split("Megatron flags")[0]
    assert "None" not in table and "…" not in out, out
    assert table.count("none: all kept") == 4, table
    for head in ("variant", "recompute", "kept", "recomputed", "budget GiB"):
        assert head in table, table
    assert max(len(ln) for ln in table.splitlines()) <= 80
    rc, out, err = run(capsys, "plan", "--fused-loss", "--seq", "262144")
    assert rc == 0, err
    table = out.split("Recompute plan")[1].split("Megatron flags")[0]
    # (4 layers recomputed a stage since the presets are the driver's totals; 5 before)
    assert "full block 4/stage" in table and "…" not in out and "None" not in table, out


def test_recompute_summary_cells():
    from relaymoe.cli import recompute_summary

    none = {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    assert recompute_summary(none) == "none: all kept"
    full = {"recompute_granularity": "full", "recompute_method": "block",
            "recompute_num_layers": 3, "recompute_modules": None}  # fmt: skip
    assert recompute_summary(full) == "full block 3/stage"
    sel = {"recompute_granularity": "selective", "recompute_method": None,
           "recompute_num_layers": None, "recompute_modules": ["core_attn", "moe_act"]}  # fmt: skip
    assert recompute_summary(sel) == "selective (core_attn, moe_act)"


def test_flags_command(capsys):
    from relaymoe.config import load_config, to_megatron_args

    rc, out, err = run(capsys, "flags", "--config", "tiny_qwen3", "--world", "1")
    assert rc == 0, err
    flags = to_megatron_args(load_config("tiny_qwen3"))
    assert out.split() == flags
    # one flag per line, with its values (issue #52: it was one word per line)
    lines = out.splitlines()
    assert all(ln.startswith("--") for ln in lines) and len(lines) < len(flags), lines
    assert "--num-layers 4" in lines and "--swiglu" in lines and "--seq-length 512" in lines
    rc, out, _ = run(capsys, "flags", "--config", "tiny_qwen3", "--dispatcher", "alltoall")
    assert "--moe-token-dispatcher-type alltoall\n" in out and "relaymoe" not in out
    rc, out, err = run(capsys, "flags", "--config", "qwen3_30b_a3b", "--world", "16")
    assert rc == 2 and out == "" and "Traceback" not in err
    assert "needs tp*cp*pp*dp = 2*4*4*1 = 32 GPUs, but the job has 16" in err, err
    rc, _, err = run(capsys, "flags", "--config", "nope")
    assert rc == 2 and "not found" in err
    rc, _, err = run(capsys, "flags", "--config", "tiny_qwen3", "--world", "0")
    assert rc == 2 and "at least one GPU" in err


def test_plan_schedule_with_gpus_per_node(capsys):
    """``--gpus-per-node`` (issue #18): the schedule picked and the hop times of both."""
    rc, out, err = run(capsys, "plan", "--gpus-per-node", "4")
    assert rc == 0, err
    assert "ring schedule: two_level (EP=8 over 2 nodes of 4 EP ranks)" in out
    assert " *two_level    inside nodes " in out and "  flat         inside nodes " in out
    rc, out, err = run(capsys, "plan", "--gpus-per-node", "4", "--json")
    d = json.loads(out)
    assert d["schedule"] == "two_level" and d["gpus_per_node"] == 4
    expert = d["hop_times"]["flat"]["mode"] == "expert"  # node_batched: expert mode only
    assert set(d["hop_times"]) == {"flat", "two_level"} | ({"node_batched"} if expert else set())
    assert d["hop_times"]["two_level"]["step_s"] < d["hop_times"]["flat"]["step_s"]
    rc, out, err = run(capsys, "plan", "--gpus-per-node", "4", "--mode", "expert")
    assert rc == 0 and "  node_batched inside nodes " in out and "*two_level" in out  # never picked
    assert " GiB" in out.split("  node_batched inside nodes ")[1].splitlines()[0]
    rc, out, err = run(capsys, "plan", "--gpus-per-node", "4", "--mode", "expert", "--json")
    h = json.loads(out)["hop_times"]
    # the node's 4 partitions gathered (and their gradients): more than the flat ring holds
    assert h["node_batched"]["layer_peak_bytes"] > h["flat"]["layer_peak_bytes"]
    assert h["flat"]["layer_peak_bytes"] == h["two_level"]["layer_peak_bytes"] > 0
    rc, out, err = run(capsys, "plan")
    assert rc == 0 and "ring schedule: flat (EP=8 in one node (--gpus-per-node N" in out
    rc, out, err = run(capsys, "plan", "--gpus-per-node", "3")
    assert rc == 2 and "parallel.gpus_per_node=3" in err and "fix:" in err


def _flag_lines(capsys, *argv):
    rc, out, err = run(capsys, "flags", *argv)
    assert rc == 0, err
    return out.split(), err


def test_plan_and_flags_print_the_same_flags(capsys):
    """Issue #32: one source of truth (the config with the overrides, ``to_megatron_args``):
    ``plan`` printed the resolved ring mode and its own recompute, ``flags`` the config's."""
    overrides = (
        [], ["--dp", "2"], ["--mbs", "2"], ["--seq", "131072"],
        ["--fused-loss", "--mode", "token"], ["--dispatcher", "alltoall"],
    )  # fmt: skip
    for over in overrides:
        flags, _ = _flag_lines(capsys, *over)
        rc, out, err = run(capsys, "plan", "--json", *over)
        assert rc == 0, err
        d = json.loads(out)
        assert d["megatron_args"] == flags, over
    # qwen3_30b_a3b at 32k: the planner keeps every layer, the config recomputes them all: the
    # plan says so, with the flags to use, instead of printing other flags than `flags`
    rc, out, _ = run(capsys, "plan", "--json")
    d = json.loads(out)
    assert "--relaymoe-mode auto" in " ".join(d["megatron_args"])
    assert d["routing_mode"] == "alltoall" and d["planned_recompute_flags"] == []
    assert any("the recompute planner's plan is no recompute flags" in n for n in d["notes"])


def test_overrides_that_change_a_derived_value_say_so(capsys):
    flags, err = _flag_lines(capsys, "--dp", "2")
    i = flags.index("--global-batch-size")
    assert flags[i + 1] == "64"  # kept: the optimiser's batch, not mbs*dp
    assert "global batch size stays 64" in err and "32 micro-batches a step (was 64)" in err
    rc, out, _ = run(capsys, "plan", "--json", "--mbs", "2")
    notes = json.loads(out)["notes"]
    assert any("global batch size stays 64" in n for n in notes), notes
    rc, out, err = run(capsys, "flags", "--dp", "3")
    assert rc == 2 and out == "" and "not a multiple of micro_batch_size*dp = 1*3" in err
    assert "--gbs" in err and err.count("\n") == 1
    flags, err = _flag_lines(capsys, "--dp", "3", "--gbs", "63")
    assert flags[flags.index("--global-batch-size") + 1] == "63" and "note" not in err
    flags, err = _flag_lines(capsys, "--seq", "131072")
    assert flags[flags.index("--max-position-embeddings") + 1] == "131072"
    assert "seq_length=131072 exceeds model.max_position_embeddings=40960" in err


def test_a_config_without_a_global_batch(capsys, tmp_path):
    import yaml

    from tests.fixtures import small_config_dict

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small_config_dict()))
    flags, err = _flag_lines(capsys, "--config", str(path), "--mbs", "4")
    assert flags[flags.index("--global-batch-size") + 1] == "4"
    assert "micro_batch_size*dp = 4 (was 2; the config sets none)" in err


def test_gpu_too_small_is_one_line(capsys):
    rc, out, err = run(capsys, "plan", "--gpu", "2GiB")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "--gpu '2GiB' is 2.00 GiB, which leaves nothing usable" in err and "-0.0" not in err
    rc, out, _ = run(capsys, "plan", "--json", "--gpu", "h100-80gb")
    d = json.loads(out)
    assert d["gpu_bytes"] == 81_559 * 2**20 and 0 < d["usable_bytes"] < d["gpu_bytes"]


def _yaml_with(tmp_path, old: str, new: str, name: str = "c.yaml") -> str:
    """tiny_qwen3.yaml with ``old`` replaced by ``new``."""
    text = (CONFIG_DIR / "tiny_qwen3.yaml").read_text()
    assert old in text, old
    path = tmp_path / name
    path.write_text(text.replace(old, new, 1))
    return str(path)


def test_plan_and_flags_refuse_what_the_launch_refuses(capsys, tmp_path):
    """Issue #50: ``plan``/``flags`` printed flags (exit 0) for layouts the plugin refuses at
    launch (``relaymoe.megatron.validate``'s checks, run here on the printed flags): each is
    exit 2 with one line naming the option, its value and the fix, and nothing on stdout."""
    etp2 = _yaml_with(tmp_path, "etp: 1\n  dp: 1", "etp: 2\n  dp: 2", "etp2.yaml")
    mtp = _yaml_with(tmp_path, "num_layers: 4", "num_layers: 4\n  mtp_num_layers: 1", "mtp.yaml")
    cases = [
        (["--config", "tiny_qwen3", "--etp", "2", "--dp", "2"],
         "expert tensor parallelism is not supported with the ring dispatcher "
         "(expert_tensor_parallel_size=2); fix: pass --expert-tensor-parallel-size 1"),
        (["--config", etp2], "(expert_tensor_parallel_size=2); fix:"),
        (["--config", mtp, "--fused-loss"],
         "--relaymoe-fused-loss cannot run these arguments (the launch refuses it): "
         "mtp_num_layers=1: the multi-token-prediction heads"),
        (["--transport", "copy_engine", "--gpus-per-node", "4"],
         "relaymoe_transport='copy_engine' needs each EP group on one node (symmetric memory), "
         "but an EP group of 8 ranks (8 consecutive ranks) spans nodes of "
         "relaymoe_gpus_per_node=4 GPUs; fix: pass --relaymoe-transport nccl"),
    ]  # fmt: skip
    for argv, msg in cases:
        for command in ("flags", "plan"):
            rc, out, err = run(capsys, command, *argv)
            assert rc == 2 and out == "" and "Traceback" not in err, (command, argv, err)
            assert err.startswith(f"relaymoe {command}: error: ") and msg in err, (argv, err)
            assert err.count("\n") == 1, err
    # the same layouts where the launch takes them: exit 0
    accepted = [
        ["--config", "tiny_qwen3", "--etp", "2", "--dp", "2", "--dispatcher", "alltoall"],
        ["--config", mtp],  # multi-token prediction without the fused loss
        ["--transport", "copy_engine", "--gpus-per-node", "8"],  # EP=8 in one node
        ["--transport", "nccl", "--gpus-per-node", "4"],
    ]
    for argv in accepted:
        for command in ("flags", "plan"):
            rc, out, err = run(capsys, command, *argv)
            assert rc == 0 and out, (command, argv, err)


def test_megatron_namespace_reads_the_flags_as_megatron_parses_them():
    from relaymoe.config import megatron_namespace

    ns = megatron_namespace(["--num-layers", "4", "--norm-epsilon", "1e-06", "--swiglu",
                             "--disable-bias-linear", "--normalization", "RMSNorm",
                             "--recompute-modules", "core_attn", "moe_act", "--bf16"])  # fmt: skip
    assert ns.num_layers == 4 and ns.norm_epsilon == 1e-6 and ns.swiglu is True
    assert ns.add_bias_linear is False and not hasattr(ns, "disable_bias_linear")
    assert ns.normalization == "RMSNorm" and ns.bf16 is True
    assert ns.recompute_modules == ["core_attn", "moe_act"]


def test_plan_prints_each_policys_longest_sequence_and_megatrons_flags_for_alltoall(capsys):
    """Issue #53: the longest sequence per recompute policy under TE (or local layers), and,
    for an alltoall user, megatron-core's own memory flags as the alternative."""
    from relaymoe.planner.policies import POLICIES, mcore_memory_flags

    args = ("plan", "--config", "qwen3_slice_v152k", "--ep", "1", "--dp", "1")
    rc, out, err = run(capsys, *args, "--dispatcher", "alltoall", "--fused-loss")
    assert rc == 0, err
    rc, js, _ = run(capsys, *args, "--dispatcher", "alltoall", "--fused-loss", "--json")
    d = json.loads(js)
    assert "Longest sequence per recompute policy (TransformerEngine" in out
    lines = {ln.split("  full")[0].strip(): ln for ln in out.splitlines() if "  full " in ln}
    for label, v in (("alltoall + fused loss", "alltoall_fused_loss"),
                     ("ring + fused loss", "ring_fused_loss")):  # fmt: skip
        for policy in POLICIES:
            r = d["policies"][v][policy]
            assert f"{policy} {r['max_seq']:>8} ({r['binding_term']})" in lines[label]
    alt = " ".join(mcore_memory_flags())
    assert "megatron-core's own memory flags" in out and alt in out.replace("\n", " ")
    assert d["mcore_memory_flags"] == mcore_memory_flags()
    rc, out, _ = run(capsys, *args)  # the ring's user: no alternative printed
    assert rc == 0 and "megatron-core's own memory flags" not in out
    rc, js, _ = run(capsys, *args, "--transformer-impl", "local", "--json")
    local = json.loads(js)
    assert local["transformer_impl"] == "local"
    # local layers' input norm is its own module: megatron-core's layernorm recompute saves more
    sel = lambda p: p["policies"]["alltoall_fused_loss"]["selective"]["max_seq"]  # noqa: E731
    assert sel(local) > sel(d)
