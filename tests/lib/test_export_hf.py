"""``relaymoe export-hf`` and ``relaymoe check-hf``: Hugging Face -> Megatron -> Hugging Face.

The tiny random Qwen3-MoE of ``tests/conftest.py`` (``tiny_hf``) and its conversions
(``converted_local``: two processes at PP 2, local keys; ``converted_te_ep2``: two processes at
EP 2, TE keys, each rank's experts in its own file) come back out of ``export-hf``:

* with no training, bitwise: every tensor of the exported folder equals the original's, name
  for name, and its ``config.json`` is the original's architecture; also for a tied, partly
  dense variant (its layers are saved one key per layer, not stacked);
* after a few ring training steps at EP 2 (two gloo processes: the model ``--moe-token-
  dispatcher-type ring`` builds, loaded from the EP 2 conversion, Adam on the host with the
  gradients reduced as Megatron's DDP reduces them, saved by Megatron's ``save_checkpoint``):
  transformers loads the export and gives the trained Megatron model's logits within 1e-5
  relative (fp32), and ``check-hf`` says PASS;
* ``check-hf`` says FAIL (exit 1) for a folder with two experts of one layer swapped.

Bad inputs get one line naming the problem and the fix, exit status 2, no traceback: a missing
file of the checkpoint, a chunk of one EP rank's experts missing from its metadata, an output
folder that exists, a folder that is no checkpoint, a model Qwen3-MoE cannot express, a folder
of another architecture, an EP the checkpoint's experts cannot be split over.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.fixtures import (
    TINY_QWEN3_MOE,
    convert_hf,
    end_left_running,
    needs,
    run_relaymoe,
    run_world,
    safetensors_tensors,
    tiny_qwen3_moe,
    world_mark,
)

pytestmark = [pytest.mark.slow, needs("transformers", "safetensors", "megatron.training"),
              pytest.mark.xdist_group("hf_checkpoints")]  # fmt: skip
STEPS, LR = 3, 1e-2

# A few ring training steps at EP = 2 on the host: the model as pretrain builds it, loaded from
# the conversion, each rank its own tokens; dense gradients averaged over the data-parallel
# group and expert gradients over the expert-data-parallel group (what Megatron's DDP does),
# Adam, then Megatron's save_checkpoint (and its writer process stopped); rank 0 saves the
# logits of fixed prompts before and after training
_TRAIN = """
import json, sys
import torch, torch.distributed as dist


def main():
    from relaymoe.convert_hf import host
    load, flags, save, prompts, out, steps, lr = sys.argv[1:8]
    flags, prompts, steps, lr = json.loads(flags), json.loads(prompts), int(steps), float(lr)
    host.cpu_only_load()
    host.init_distributed()
    from megatron.core import parallel_state as ps
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint
    from relaymoe.megatron.checkpoint_writer import stop_checkpoint_writer
    world, rank = dist.get_world_size(), dist.get_rank()
    seq = len(prompts[0])
    argv = [*host.host_argv(flags, world=world, ep=world, seq=seq), "--load", load, "--save", save,
            "--save-interval", "1", "--no-load-optim", "--no-load-rng", "--no-save-optim",
            "--no-save-rng"]
    model, args = host.build_model(argv, prog="train", ep=world)
    impl = flags[flags.index("--transformer-impl") + 1]
    host.use_keys_of(model, impl)
    args.transformer_impl = impl
    load_checkpoint([model], None, None, strict=True)
    pos = torch.arange(seq).unsqueeze(0)
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).logical_not().view(1, 1, seq, seq)
    def logits():
        model.eval()
        with torch.no_grad():
            return [model(torch.tensor([p]), pos, mask)[0] for p in prompts]
    before = logits()
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    groups = {True: ps.get_data_parallel_group(), False: ps.get_expert_data_parallel_group()}
    g = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, args.padded_vocab_size, (1, seq + 1), generator=g)
        loss = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:]).float().mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            group = groups[getattr(p, "allreduce", True)]
            dist.all_reduce(p.grad, group=group)
            p.grad /= dist.get_world_size(group)
        opt.step()
        losses.append(float(loss))
    after = logits()
    save_checkpoint(steps, [model], None, None, 0)
    stop_checkpoint_writer()  # this process leaves through os._exit: its exit handler never runs
    if rank == 0:
        torch.save({"before": before, "after": after, "losses": losses}, out)
    print("TRAINED", losses)
    dist.destroy_process_group()


if __name__ == "__main__":  # the checkpoint writer spawns a process that imports this file
    main()
"""


def prompts(n: int = 2, seq: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, TINY_QWEN3_MOE["vocab_size"], (n, seq), generator=g).tolist()


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def relaymoe(capsys, *args: str) -> tuple[int, str]:
    """``relaymoe ARGS`` in this process: (exit status, stderr)."""
    from relaymoe.cli import main

    capsys.readouterr()
    rc = main(list(args))
    return rc, capsys.readouterr().err


def export(capsys, ckpt: Path, out: Path, *extra: str) -> Path:
    rc, err = relaymoe(capsys, "export-hf", "--load", str(ckpt), "--out", str(out), *extra)
    assert rc == 0, err
    return out


def assert_one_line_error(rc: int, err: str, *pieces: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    for piece in pieces:
        assert piece in lines[0], (piece, lines[0])


def assert_same_folder(got: Path, want: Path) -> None:
    """Every tensor of ``got`` equals ``want``'s bitwise (same names, dtypes, shapes, bits),
    and config.json describes the same architecture."""
    from relaymoe.convert_hf.hf_config import architecture, read_hf_config

    a, b = safetensors_tensors(got), safetensors_tensors(want)
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for name, t in b.items():
        assert a[name].dtype == t.dtype and torch.equal(a[name], t), name
    assert architecture(read_hf_config(str(got))) == architecture(read_hf_config(str(want)))


@pytest.fixture(scope="module")
def tied_dense(tiny_hf):
    """(Hugging Face folder, checkpoint): a tied-embedding variant whose first layer is dense,
    converted at EP 1 with the local keys (megatron-core saves mixed layers one key per layer)."""
    root = tiny_hf[0].parent
    hf = root / "hf_tied_dense"
    tiny_qwen3_moe(hf, seed=11, tie_word_embeddings=True, mlp_only_layers=[0])
    ckpt = root / "ckpt_tied_dense"
    convert_hf(hf, ckpt, "--transformer-impl", "local")
    return hf, ckpt


@pytest.mark.parametrize("which", ["local-pp2", "te-ep2", "tied-dense"])
def test_export_round_trip_is_bitwise(request, capsys, tiny_hf, tmp_path, which):
    if which == "tied-dense":
        hf, ckpt = request.getfixturevalue("tied_dense")
    else:
        hf = tiny_hf[0]
        ckpt = request.getfixturevalue({"local-pp2": "converted_local",
                                        "te-ep2": "converted_te_ep2"}[which])[0]  # fmt: skip
    base = ("--base", str(hf)) if which == "te-ep2" else ()  # its generation config comes too
    out = export(capsys, ckpt, tmp_path / "exported", "--max-shard-size", "100KB", *base)
    assert len(list(out.glob("*.safetensors"))) > 1
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "generation_config.json").is_file() == bool(base)
    assert_same_folder(out, hf)


@pytest.fixture(scope="module")
def trained(converted_te_ep2):
    """(checkpoint, Megatron's logits before and after): ``STEPS`` ring training steps at EP 2
    from the EP 2 conversion (TE keys), saved as iteration ``STEPS``."""
    ckpt, flags = converted_te_ep2
    root = ckpt.parent
    save, out = root / "trained", root / "trained_logits.pt"
    (root / "train.py").write_text(_TRAIN)
    args = [str(root / "train.py"), str(ckpt), json.dumps(flags), str(save),
            json.dumps(prompts()), str(out), str(STEPS), str(LR)]  # fmt: skip
    for rc, o, e in run_world(args, 2, cwd=root, mark=world_mark(save)):
        assert rc == 0 and "TRAINED" in o, o[-2000:] + e[-5000:]
    assert not (left := end_left_running(world_mark(save))), f"left running (now killed): {left}"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    return save, torch.load(out)


def test_trained_ring_checkpoint_exports_to_the_same_logits(capsys, trained, tmp_path):
    """The export of a checkpoint the ring trained at EP 2 loads in transformers and gives the
    trained Megatron model's logits (1e-5 relative, fp32); training moved them far more than
    that, so the trained weights (both EP ranks' experts) are what was exported."""
    from relaymoe.check_hf.hf_logits import hf_logits

    save, logits = trained
    out = export(capsys, save, tmp_path / "exported")
    theirs, problems = hf_logits(str(out), prompts())  # transformers' from_pretrained, fp32
    assert not problems, problems
    for k, (a, b, before) in enumerate(zip(logits["after"], theirs, logits["before"],
                                           strict=True)):  # fmt: skip
        assert rel(before, a) > 1e-3, f"prompt {k}: training did not move the logits"
        err = rel(b, a)
        assert err < 1e-5, f"prompt {k}: exported logits vs Megatron's, relative error {err:.3g}"
    rc, stdout, stderr = run_relaymoe("check-hf", "--load", str(save), "--hf", str(out),
                                      cwd=tmp_path)  # fmt: skip
    assert rc == 0 and "PASS" in stdout.splitlines()[-1], stdout + stderr[-3000:]


def test_check_hf_fails_on_swapped_experts(tiny_hf, converted_local, tmp_path):
    """The original folder with experts 0 and 1 of layer 1 swapped against its conversion:
    FAIL, exit status 1, the error far above the bound."""
    from safetensors.torch import save_file

    hf = tmp_path / "swapped"
    shutil.copytree(tiny_hf[0], hf)
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = safetensors_tensors(hf)
    for part in ("gate", "up", "down"):
        a, b = (f"model.layers.1.mlp.experts.{j}.{part}_proj.weight" for j in (0, 1))
        tensors[a], tensors[b] = tensors[b], tensors[a]
    for shard in set(index.values()):
        save_file({k: v.contiguous() for k, v in tensors.items() if index[k] == shard},
                  str(hf / shard), metadata={"format": "pt"})  # fmt: skip
    rc, stdout, stderr = run_relaymoe("check-hf", "--load", str(converted_local[0]), "--hf",
                                      str(hf), cwd=tmp_path)  # fmt: skip
    assert rc == 1 and stdout.splitlines()[-1].startswith("FAIL"), stdout + stderr[-3000:]
    worst = float(stdout.splitlines()[-1].split("error ")[1].split()[0])
    assert worst > 1e-2, stdout


# ------------------------------------------------------------------------------ bad inputs
def test_export_refuses_an_incomplete_checkpoint(capsys, converted_te_ep2, tmp_path):
    """A torch_dist checkpoint saved at EP 2 has one file per rank: without rank 1's the export
    names the file; with its file but its chunks of layer 1's experts 2 and 3 gone from the
    metadata (a save that lost them), it names those experts. Never a partial folder."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted_te_ep2[0], ckpt)
    (ckpt / "release" / "__1_0.distcp").rename(tmp_path / "aside.distcp")
    rc, err = relaymoe(capsys, "export-hf", "--load", str(ckpt), "--out", str(tmp_path / "a"))
    assert_one_line_error(rc, err, "__1_0.distcp", "copy the whole folder")
    (tmp_path / "aside.distcp").rename(ckpt / "release" / "__1_0.distcp")
    meta_path = ckpt / "release" / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    md = meta.state_dict_metadata[key]
    md.chunks = [c for c in md.chunks if not (c.offsets[0] == 1 and c.offsets[1] >= 2)]
    meta_path.write_bytes(pickle.dumps(meta))
    rc, err = relaymoe(capsys, "export-hf", "--load", str(ckpt), "--out", str(tmp_path / "b"))
    assert_one_line_error(rc, err, key, "layer 1 expert 2, layer 1 expert 3")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_export_refuses_bad_folders(capsys, tiny_hf, converted_local, tmp_path):
    ckpt = str(converted_local[0])
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    rc, err = relaymoe(capsys, "export-hf", "--load", ckpt, "--out", str(taken))
    assert_one_line_error(rc, err, f"--out {taken} exists", "new folder")
    rc, err = relaymoe(capsys, "export-hf", "--load", str(tiny_hf[0]), "--out", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "no latest_checkpointed_iteration.txt", "--save folder")
    rc, err = relaymoe(capsys, "export-hf", "--load", ckpt, "--out", str(tmp_path / "o"),
                       "--iteration", "7")  # fmt: skip
    assert_one_line_error(rc, err, "--iteration 7", "release")
    legacy = tmp_path / "legacy" / "iter_0000001" / "mp_rank_00"
    legacy.mkdir(parents=True)
    rc, err = relaymoe(capsys, "export-hf", "--load", str(legacy.parent), "--out",
                       str(tmp_path / "o"))  # fmt: skip
    assert_one_line_error(rc, err, "legacy 'torch' checkpoint", "--ckpt-convert-format")
    rc, err = relaymoe(capsys, "export-hf", "--load", ckpt, "--out", str(tmp_path / "o"),
                       "--base", str(tmp_path / "legacy"))  # fmt: skip
    assert_one_line_error(rc, err, "--base", "no config.json")


def _args(**over) -> argparse.Namespace:
    """The saved arguments of the tiny model's run, as Megatron keeps them."""
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                group_query_attention=True, num_query_groups=2, kv_channels=16, num_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=32, padded_vocab_size=256,
                max_position_embeddings=64, rotary_base=1000000, layernorm_epsilon=1e-6,
                untie_embeddings_and_output_weights=True, moe_router_pre_softmax=False,
                moe_layer_freq=1, swiglu=True, qk_layernorm=True, normalization="RMSNorm",
                position_embedding_type="rope", add_bias_linear=False)  # fmt: skip
    return argparse.Namespace(**{**base, **over})


@pytest.mark.parametrize(
    "over,named",
    [
        (dict(swiglu=False), "swiglu=False"),
        (dict(add_bias_linear=True), "add_bias_linear=True"),
        (dict(moe_shared_expert_intermediate_size=64), "shared experts"),
        (dict(moe_router_score_function="sigmoid"), "moe_router_score_function='sigmoid'"),
        (dict(qk_layernorm=False), "qk_layernorm=False"),
        (dict(normalization="LayerNorm"), "normalization='LayerNorm'"),
        (dict(num_experts=None), "a dense model"),
    ],
)
def test_what_qwen3_moe_cannot_express_is_refused_by_name(over, named):
    from relaymoe.export_hf import ExportError, hf_config

    with pytest.raises(ExportError, match="not a Qwen3-MoE model") as e:
        hf_config(_args(**over), 256, "float32")
    assert named in str(e.value)


def test_config_round_trips_through_the_megatron_flags():
    """``hf_config`` (export) inverts ``megatron_model_flags`` (convert): the arguments the
    flags describe give back the architecture, the dense layers and pre-softmax router too."""
    from relaymoe.convert_hf import megatron_model_flags
    from relaymoe.convert_hf.hf_config import architecture
    from relaymoe.export_hf import hf_config

    cfg = dict(TINY_QWEN3_MOE, model_type="qwen3_moe", mlp_only_layers=[1],
               norm_topk_prob=False, tie_word_embeddings=True)  # fmt: skip
    flags = megatron_model_flags(cfg)

    def value(flag):
        return flags[flags.index(flag) + 1]

    args = _args(
        untie_embeddings_and_output_weights="--untie-embeddings-and-output-weights" in flags,
        moe_router_pre_softmax="--moe-router-pre-softmax" in flags,
        moe_layer_freq=json.loads(value("--moe-layer-freq")),
        rotary_base=int(value("--rotary-base")),
        layernorm_epsilon=float(value("--norm-epsilon")),
        moe_aux_loss_coeff=float(value("--moe-aux-loss-coeff")),
    )
    assert architecture(hf_config(args, 256, "float32")) == architecture(cfg)


def test_check_hf_refuses_what_it_cannot_compare(capsys, tiny_hf, converted_local, tmp_path):
    ckpt = str(converted_local[0])
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((tiny_hf[0] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 1}))
    rc, err = relaymoe(capsys, "check-hf", "--load", ckpt, "--hf", str(other))
    assert_one_line_error(rc, err, "num_experts_per_tok: checkpoint 2, config.json 1", "fix:")
    rc, err = relaymoe(capsys, "check-hf", "--load", ckpt, "--hf", str(tiny_hf[0]), "--ep", "3")
    assert_one_line_error(rc, err, "--ep 3", "[1, 2, 4]")
    rc, err = relaymoe(capsys, "check-hf", "--load", str(tmp_path / "none"), "--hf",
                       str(tiny_hf[0]))  # fmt: skip
    assert_one_line_error(rc, err, "no such folder")


def test_prompts_come_from_the_folders_tokenizer(tmp_path):
    """With a tokenizer in the folder the prompts are its tokens of fixed sentences; without one,
    or with one whose ids do not fit the model's vocabulary, fixed ids from a seed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from relaymoe.check_hf.prompts import TEXTS, prompts

    words = sorted({w for t in TEXTS for w in t.replace("\n", " ").split()} | {"[UNK]"})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    ids, source = prompts(str(tmp_path), vocab_size=len(words))
    assert source == "tokenizer" and len(ids) == len(TEXTS)
    assert ids[0] == tok.encode(TEXTS[0]).ids
    again, source = prompts(str(tmp_path), vocab_size=len(words) - 1)  # an id too large
    assert source == "seed" and again == prompts(str(tmp_path / "none"), len(words) - 1)[0]


def test_optimizer_state_is_left_out_and_unknown_tensors_refused(
    capsys, tiny_hf, converted_local, tmp_path
):
    """A training run's checkpoint also holds the optimizer's state (``optimizer.…``, or
    ``chained_N.optimizer.…`` with separate expert optimizers): the export leaves it out and
    gives the model's tensors alone. A tensor of a layer kind Qwen3-MoE lacks is refused by its
    key (here a multi-token-prediction layer's)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted_local[0], ckpt)
    meta_path = ckpt / "release" / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())
    router = meta.state_dict_metadata["decoder.layers.mlp.router.weight"]
    for prefix in ("optimizer.state.exp_avg.", "chained_1.optimizer.state.fp32_param."):
        meta.state_dict_metadata[prefix + "decoder.layers.mlp.router.weight"] = router
    meta_path.write_bytes(pickle.dumps(meta))
    assert_same_folder(export(capsys, ckpt, tmp_path / "out"), tiny_hf[0])
    meta.state_dict_metadata["mtp.layers.0.mlp.router.weight"] = router
    meta_path.write_bytes(pickle.dumps(meta))
    rc, err = relaymoe(capsys, "export-hf", "--load", str(ckpt), "--out", str(tmp_path / "o2"))
    assert_one_line_error(rc, err, "'mtp.layers.0.mlp.router.weight' (multi-token prediction)")
