"""train.sh's preflight (``relaymoe/megatron/preflight.py``): what the real run will read, checked
before anything is launched (issue #52). In one process, on Megatron's parsed arguments of the
tiny config's launch flags and on checkpoints written here (a ``torch_dist`` common state with
saved arguments, as megatron-core writes it; ``tests/lib/test_convert_hf.py`` runs the same
checks on real converted checkpoints):

* a checkpoint of another model is refused, naming the settings that differ (item 1);
* a checkpoint in the other ``--transformer-impl`` keys is refused with the fix that applies:
  convert again for a ``relaymoe convert-hf`` one, resume with its implementation otherwise
  (item 2);
* a resume whose distributed-optimizer state was saved at another TP/PP/EP is refused unless
  nothing of that state is read;
* the cluster: ``MASTER_ADDR`` required, resolvable and not loopback across nodes (item 3),
  the GPUs visible on a real launch (item 8), the config's GPUs per node;
* the options: the launch's own checks, from the one function ``relaymoe flags``/``plan`` run
  too (item 7).
"""

from __future__ import annotations

import argparse
import io
import json
import warnings
from pathlib import Path

import pytest

from tests.fixtures import needs

pytestmark = needs("megatron.training")

TRAIN = ["--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer"]


@pytest.fixture(scope="module")
def launch():
    """``(flags, parse)``: the tiny config's flags and Megatron's parser of a launch line."""
    from relaymoe.config import load_config, to_megatron_args
    from relaymoe.megatron import preflight

    flags = [*to_megatron_args(load_config("tiny_qwen3")), *TRAIN]

    def parse(*extra):
        args, why = preflight.parsed_args([*flags, *extra])
        assert why is None, why
        return args

    return flags, parse


def write_checkpoint(folder: Path, args, *, iteration: int | None = None, content=None) -> Path:
    """A ``torch_dist`` checkpoint folder holding only its common state (the saving run's
    ``args`` and ``content`` metadata), in megatron-core 0.19.2's layout: the tracker file, the
    iteration folder with ``metadata.json`` and the ``common_state`` object (what
    ``load_common_state_dict`` reads; no tensor)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    name = "release" if iteration is None else f"iter_{iteration:07d}"
    path = folder / name
    path.mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text(
        "release" if iteration is None else str(iteration)
    )
    backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    (path / "metadata.json").write_text(json.dumps(backend))
    state = {"args": args, "iteration": iteration or 0, "checkpoint_version": 3.0}
    if content is not None:
        state["content_metadata"] = content
    buf = io.BytesIO()
    torch.save([state], buf)
    buf.seek(0)
    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({key: buf}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return folder


def _saved(args, **changes):
    """The arguments a run of ``args`` would save, with ``changes``."""
    out = argparse.Namespace(**vars(args))
    for k, v in changes.items():
        setattr(out, k, v)
    return out


# --------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_of_another_model_is_refused_by_name(launch, tmp_path):
    """Item 1: a 2-layer, hidden-64 checkpoint as PRETRAINED of a 4-layer, hidden-256 run."""
    from relaymoe.megatron.preflight import checkpoint_problems

    _, parse = launch
    small = _saved(parse(), num_layers=2, hidden_size=64, ffn_hidden_size=96, kv_channels=16)
    ck = write_checkpoint(tmp_path / "small", small)
    run = parse("--load", str(ck), "--padded-vocab-size", "1024")
    problems = checkpoint_problems(run, pretrained=str(ck), save_dir=None)
    assert len(problems) == 1, problems
    p = problems[0]
    assert p.startswith(f"PRETRAINED={ck} holds another model than this run builds (")
    assert "num_layers: checkpoint 2, this run 4" in p and "hidden_size: checkpoint 64" in p
    assert "fix: the config the checkpoint was made for" in p and "\n" not in p
    # the same model (its derived defaults filled in on both sides) passes
    same = write_checkpoint(tmp_path / "same",
                            _saved(parse(), kv_channels=None, padded_vocab_size=1024))  # fmt: skip
    assert checkpoint_problems(parse("--load", str(same), "--padded-vocab-size", "1024"),
                               pretrained=str(same), save_dir=None) == []  # fmt: skip
    # the embedding's rows, when the run fixes them (train.sh does, with PRETRAINED)
    (p,) = checkpoint_problems(parse("--load", str(same), "--padded-vocab-size", "2048"),
                               pretrained=None, save_dir=None)  # fmt: skip
    assert p.startswith(f"--load {same} holds another model") and (
        "padded_vocab_size: checkpoint 1024, this run 2048" in p
    ), p


def test_architecture_compares_parsed_and_saved_arguments(launch):
    from relaymoe.megatron.checkpoint_compat import architecture_mismatch, model_settings

    _, parse = launch
    args = parse()
    settings = model_settings(args)
    assert settings["moe_layer_pattern"] == (1, 1, 1, 1) and settings["num_query_groups"] == 4
    saved = _saved(args, moe_layer_freq=[1, 1, 1, 1], swiglu=True, ffn_hidden_size=512)
    assert architecture_mismatch(saved, args) == []
    diff = architecture_mismatch(_saved(args, moe_layer_freq=[0, 1, 1, 1], rotary_base=10000), args)
    assert [d.split(":")[0] for d in diff] == ["moe_layer_pattern", "rotary_base"], diff


def test_a_checkpoint_of_the_other_layer_implementation_says_how_to_fix_it(launch, tmp_path):
    """Item 2: converted with TE keys, run where TE is absent (local): convert it again; a
    training checkpoint: resume with its implementation (which needs TE)."""
    from relaymoe.megatron.checkpoint_compat import CONVERTED_MARK
    from relaymoe.megatron.preflight import checkpoint_problems

    _, parse = launch
    te = _saved(parse(), transformer_impl="transformer_engine", **{CONVERTED_MARK: True})
    ck = write_checkpoint(tmp_path / "te", te)
    run = parse("--pretrained-checkpoint", str(ck), "--transformer-impl", "local")
    (p,) = checkpoint_problems(run, pretrained=str(ck), save_dir=None)
    head = f"PRETRAINED={ck}: the checkpoint was saved with --transformer-impl transformer_engine"
    assert p.startswith(head) and "and this run builds --transformer-impl local" in p
    assert "fix: convert it again for this run" in p and "--transformer-impl local'" in p
    trained = write_checkpoint(tmp_path / "run", _saved(parse(), transformer_impl="local"),
                               iteration=10)  # fmt: skip
    run = parse("--load", str(trained), "--transformer-impl", "transformer_engine")
    (p,) = checkpoint_problems(run, pretrained=None, save_dir=str(trained))
    assert p.startswith(f"SAVE_DIR={trained}: ")
    assert "fix: resume with --transformer-impl local" in p


def test_a_resume_at_another_layout_is_refused_unless_no_optimizer_state_is_read(launch, tmp_path):
    from relaymoe.megatron.preflight import checkpoint_problems

    _, parse = launch
    ck = write_checkpoint(tmp_path / "ep1", _saved(parse()), iteration=20,
                          content={"distrib_optim_sharding_type": "dp_reshardable"})  # fmt: skip
    at_ep2 = ("--load", str(ck), "--expert-model-parallel-size", "2")
    (p,) = checkpoint_problems(parse(*at_ep2), pretrained=None, save_dir=str(ck))
    assert "saved at TP=1 PP=1 EP=1" in p and "resumes at TP=1 PP=1 EP=2" in p
    assert "fix: resume at TP=1 PP=1 EP=1, or pass --no-load-optim" in p
    assert checkpoint_problems(parse(*at_ep2, "--no-load-optim"), pretrained=None,
                               save_dir=None) == []  # fmt: skip
    assert checkpoint_problems(parse(*at_ep2[2:], "--pretrained-checkpoint", str(ck), "--load",
                                     str(tmp_path / "empty")), pretrained=None,
                               save_dir=None) == []  # a start from it: weights only  # fmt: skip
    anywhere = {"distrib_optim_sharding_type": "fully_reshardable"}
    full = write_checkpoint(tmp_path / "full", _saved(parse()), iteration=20, content=anywhere)
    assert checkpoint_problems(parse("--load", str(full), *at_ep2[2:]), pretrained=None,
                               save_dir=None) == []  # fmt: skip


def test_broken_checkpoint_folders_are_named(tmp_path):
    from relaymoe.megatron.checkpoint_info import read_checkpoint

    assert read_checkpoint(str(tmp_path)).startswith("not a Megatron checkpoint (no latest_")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12")
    assert "names iter_0000012, which it does not hold" in read_checkpoint(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("x")
    assert "neither an iteration nor 'release'" in read_checkpoint(str(tmp_path))


# ------------------------------------------------------------------------------- cluster
def test_master_addr_is_required_and_not_loopback_across_nodes():
    """Item 3: NNODES > 1 needs node 0's address; one node needs none."""
    from relaymoe.megatron.cluster_checks import cluster_problems

    def check(addr, nnodes=4):
        return cluster_problems(nnodes=nnodes, gpus_per_node=8, master_addr=addr,
                                master_port=29500)  # fmt: skip

    (p,) = check("")
    assert p.startswith("MASTER_ADDR is not set and NNODES=4") and "fix: export MASTER_ADDR" in p
    (p,) = check("localhost")
    assert "is a loopback address" in p and "every node would wait for itself" in p
    (p,) = check("no-such-host.invalid")
    assert "does not resolve on this node" in p
    assert check("10.0.0.1") == [] and check("", nnodes=1) == []


def test_a_launch_needs_its_gpus_visible_and_the_configs_node_size():
    """Item 8: fewer visible GPUs than GPUS_PER_NODE on a real launch (a dry run passes None);
    and a config whose parallel.gpus_per_node is not the cluster's."""
    from relaymoe.megatron.cluster_checks import cluster_problems

    def check(**kw):
        return cluster_problems(nnodes=1, gpus_per_node=2, master_addr="", master_port=1, **kw)

    (p,) = check(visible_gpus=0)
    assert p.startswith("no GPU is visible here") and "GPUS_PER_NODE=2" in p and "DRY_RUN=1" in p
    (p,) = check(visible_gpus=1)
    assert p.startswith("this node sees 1 GPU(s)")
    assert check(visible_gpus=2) == check(visible_gpus=None) == []
    (p,) = check(config_gpus_per_node=8)
    assert "--relaymoe-gpus-per-node 8" in p and "GPUS_PER_NODE=2" in p


# ------------------------------------------------------------------------------- options
def test_options_are_checked_by_the_launchs_own_function(launch, monkeypatch, capsys):
    """Item 7: the copy engine across nodes is refused by ``relaymoe flags`` and by the
    preflight (with the cluster's GPUs per node), both through ``validate.launch_refusal``,
    the function the launch's patched ``validate_args`` runs."""
    from relaymoe.cli import main
    from relaymoe.megatron import preflight, validate

    _, parse = launch
    rc = main(["flags", "--transport", "copy_engine", "--gpus-per-node", "4", "--world", "32"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "relaymoe_transport='copy_engine'" in err, err
    args = parse("--expert-model-parallel-size", "1", "--relaymoe-transport", "copy_engine")
    assert preflight.options_problems(args, gpus_per_node=8) == []
    wide = parse("--relaymoe-transport", "copy_engine", "--expert-model-parallel-size", "8")
    (p,) = preflight.options_problems(wide, gpus_per_node=4)
    assert "needs each EP group on one node" in p and "(the launch refuses it)" in p
    # one rule, one place: replacing that function changes what both report
    monkeypatch.setattr(validate, "launch_refusal", lambda args: "REFUSED BY THE LAUNCH")
    assert preflight.options_problems(parse(), gpus_per_node=1) == ["REFUSED BY THE LAUNCH"]
    assert main(["flags", "--config", "tiny_qwen3"]) == 2
    assert "REFUSED BY THE LAUNCH" in capsys.readouterr().err


def test_preflight_prints_one_line_per_problem_and_exits_2(launch, tmp_path, capsys):
    from relaymoe.megatron import preflight

    flags, _ = launch
    own = ["--nnodes", "2", "--gpus-per-node", "1", "--dry-run", "--pretrained",
           str(tmp_path / "none")]  # fmt: skip
    assert preflight.main([*own, "--", *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(ln.endswith("; nothing was launched") for ln in err), err
    assert "MASTER_ADDR is not set" in err[0] and "not a Megatron checkpoint" in err[1]
    assert preflight.main(["--dry-run", "--", *flags]) == 0
    assert capsys.readouterr().err == ""


def test_dry_run_says_which_expert_gemms_run_in_fp8(launch, capsys):
    """Under an fp8 recipe a dry run prints the line the run would print at start: auto's bf16
    experts and why, or ``on``'s fp8 GEMMs; without fp8, nothing."""
    from relaymoe.megatron import preflight

    flags, _ = launch
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    assert preflight.main(["--dry-run", "--", *flags, *fp8]) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("[relaymoe] fp8 format hybrid, recipe tensorwise"), line
    assert "--relaymoe-fp8-experts auto keeps them there" in line and "ms at" in line, line
    assert preflight.main(["--dry-run", "--", *flags, *fp8, "--relaymoe-fp8-experts", "on"]) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert "routed experts run fprop/dgrad/wgrad in fp8" in line, line
    assert preflight.main(["--", *flags, *fp8]) == 0  # a real launch: the run prints it
    assert capsys.readouterr().err == ""
