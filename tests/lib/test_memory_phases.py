"""``--relaymoe-memory-phases``: a step's peak and its breakdown in the planner's terms, from the
allocator's counters at the phase boundaries (``relaymoe/megatron/memory_phases.py``), on CPU:
the breakdown of hand-made marks for a peak in each phase, and the hooks on a GPT-shaped model
and an optimizer recording those marks in order (the CUDA counters replaced by a fake
allocator)."""

from __future__ import annotations

import argparse

import pytest
import torch

from relaymoe.megatron import memory_phases as mp
from relaymoe.megatron.pretrain import extra_args
from relaymoe.planner.recompute import SEQUENCE_TERMS

GiB = 2**30


def marks(*pairs):
    """MARKS in order from (allocated, running max) pairs in GiB."""
    return {m: (int(a * GiB), int(x * GiB)) for m, (a, x) in zip(mp.MARKS, pairs, strict=True)}


def test_a_peak_in_the_backward_is_the_layer_working_set():
    # 50 GiB of states; the layers keep 2; the loss reaches 58; the backward 70; the optimizer 55
    b = mp.breakdown(marks((50, 50), (52, 53), (51, 58), (50.5, 70), (50, 70)))
    assert b["peak_bytes"] == 70 * GiB and b["peak_phase"] == "backward"
    t = b["terms"]
    assert t["model_states"] == 50 * GiB and t["activations_retained"] == 2 * GiB
    assert t["layer_working_set"] == 18 * GiB  # over states + retained
    assert t["logits_loss"] is None and t["optimizer_step"] is None  # not at the peak
    assert sum(v for v in t.values() if v) == b["peak_bytes"]
    assert b["binding_term"] == "layer_working_set"
    assert b["marks"]["optimizer_start"] == [int(50.5 * GiB), 70 * GiB]


def test_a_peak_in_the_loss_is_the_logits_loss_and_retained_can_bind():
    b = mp.breakdown(marks((50, 50), (52, 53), (51, 75), (50, 75), (50, 75)))
    assert b["peak_phase"] == "loss" and b["terms"]["logits_loss"] == 23 * GiB
    assert b["binding_term"] == "logits_loss" and b["terms"]["layer_working_set"] is None
    # no recompute: what the layers keep outgrows the loss's transient
    b = mp.breakdown(marks((50, 50), (70, 71), (69, 72), (60, 72), (50, 72)))
    assert b["peak_phase"] == "loss" and b["terms"]["activations_retained"] == 20 * GiB
    assert b["binding_term"] == "activations_retained"
    # the layers' own forward (one layer's transient over what they keep at the end)
    b = mp.breakdown(marks((50, 50), (60, 66), (59, 62), (55, 64), (50, 66)))
    assert b["peak_phase"] == "layers_forward" and b["terms"]["layer_working_set"] == 6 * GiB


def test_a_peak_in_the_optimizer_names_its_own_term():
    b = mp.breakdown(marks((50, 50), (51, 51), (51, 52), (50, 53), (50, 61)))
    assert b["peak_phase"] == "optimizer" and b["terms"]["optimizer_step"] == 11 * GiB
    assert b["terms"]["activations_retained"] is None and b["binding_term"] == "optimizer_step"
    assert set(SEQUENCE_TERMS) <= set(b["terms"])  # the planner's names, all present


def test_missing_marks_are_named():
    m = marks((50, 50), (52, 53), (51, 58), (50.5, 70), (50, 70))
    del m["loss_start"]
    with pytest.raises(ValueError, match=r"\['loss_start'\]"):
        mp.breakdown(m)


class FakeAllocator:
    """torch.cuda's two counters, moved by the fake model's modules."""

    def __init__(self, base: int):
        self.now = self.peak = base

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def free(self, n: int) -> None:
        self.now -= n


class Gpt(torch.nn.Module):
    """A GPT model's shape as the recorder finds it: decoder (layers, final_layernorm) and an
    output layer, forwarding through them in Megatron's order."""

    def __init__(self, mem: FakeAllocator):
        super().__init__()
        self.mem = mem
        self.decoder = torch.nn.Module()
        self.decoder.final_layernorm = torch.nn.Identity()
        self.output_layer = torch.nn.Identity()

    def forward(self, x):
        self.mem.alloc(10)  # a layer's transient
        self.mem.free(7)  # it keeps 3 for backward
        x = self.decoder.final_layernorm(x)
        self.mem.alloc(20)  # logits and the loss
        self.mem.free(20)
        return self.output_layer(x)


def test_the_recorder_hooks_take_the_marks_in_order(monkeypatch):
    mem = FakeAllocator(100)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: mem.now)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: mem.peak)
    model = Gpt(mem)
    chunk = torch.nn.Sequential(torch.nn.Sequential(model))  # wrapped, as DDP and Float16Module

    class Optimizer:
        def step(self):
            mem.alloc(5)
            mem.free(5)
            return True

    opt = Optimizer()
    rec = mp.PhaseRecorder()
    rec.attach([chunk], opt)
    rec.attach([chunk], opt)  # once only: no second hook
    for _ in range(2):
        mem.now = mem.peak = 100  # the report resets the peak as a step starts
        rec.start()
        chunk(torch.ones(2))
        mem.alloc(30)  # backward
        mem.free(33)  # ... frees what the layers kept, and more
        assert opt.step() is True
        b = rec.finish()
        assert b["marks"]["forward_start"] == [100, 100]
        assert b["marks"]["loss_start"] == [103, 110]
        assert b["marks"]["forward_end"] == [103, 123]
        assert b["marks"]["optimizer_start"] == [100, 133]
        assert b["peak_phase"] == "backward" and b["terms"]["layer_working_set"] == 30
        assert b["terms"]["activations_retained"] == 3
    # a rank without the model's last stage: marks missing, said in the line
    rec = mp.PhaseRecorder()
    rec.attach([torch.nn.Linear(2, 2)], Optimizer())
    rec.start()
    assert "not taken" in rec.finish()["error"]


def test_pretrain_parses_the_memory_phases_flag():
    a = extra_args(argparse.ArgumentParser()).parse_args(
        ["--relaymoe-report", "r.jsonl", "--relaymoe-memory-phases"]
    )
    assert a.relaymoe_memory_phases is True


def test_the_step_report_writes_each_steps_phases(monkeypatch, tmp_path):
    """``pretrain``'s step report with ``--relaymoe-memory-phases``, around a fake Megatron
    ``train_step`` (the CUDA counters faked): one line a step, each with that step's phases
    (the second step's base holds the optimizer states the first one made)."""
    import json
    from types import SimpleNamespace

    from megatron.training import training

    from relaymoe.megatron import pretrain

    mem = FakeAllocator(100)
    for name, fn in (("memory_allocated", lambda *a: mem.now),
                     ("max_memory_allocated", lambda *a: mem.peak),
                     ("synchronize", lambda *a: None)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, fn)

    def reset(*a):
        mem.peak = mem.now

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    model = torch.nn.Sequential(Gpt(mem))

    class Optimizer:
        param_groups = [{"lr": 1e-3}]
        states = 0

        def step(self):
            if not self.states:
                self.states = 40
                mem.alloc(40)  # Adam's states, made by the first step
            return True

    def train_step(fwd, data, model, optimizer, *rest):
        model[0](torch.ones(2))
        mem.alloc(30)
        mem.free(33)
        optimizer.step()
        loss = torch.tensor([2.5, 1.0])
        return {"lm loss": loss}, 0, 0

    monkeypatch.setattr(training, "train_step", train_step)
    report = tmp_path / "r.jsonl"
    args = SimpleNamespace(relaymoe_report=str(report), relaymoe_memory_phases=True,
                           relaymoe_weights_digest=False, global_batch_size=1, seq_length=8,
                           train_iters=2, moe_token_dispatcher_type="alltoall")  # fmt: skip
    pretrain._install_step_report(args)
    opt = Optimizer()
    for _ in range(2):
        training.train_step(None, None, [model], opt, None)
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[0]["loss"] == 2.5
    first, second = (x["memory_phases"] for x in lines)
    assert first["marks"]["forward_start"] == [100, 100]
    assert first["peak_phase"] == "optimizer" and first["terms"]["optimizer_step"] == 40
    assert second["marks"]["forward_start"] == [140, 140]  # this step's, not the first one's
    assert second["peak_phase"] == "backward" and second["terms"]["model_states"] == 140
    assert second["terms"]["layer_working_set"] == 30 and lines[1]["peak_MiB"] * 2**20 == 173
    args.relaymoe_memory_phases = False  # without the flag: no phases in the line
    report.unlink()
    monkeypatch.setattr(training, "train_step", train_step)
    pretrain._install_step_report(args)
    training.train_step(None, None, [model], opt, None)
    assert "memory_phases" not in json.loads(report.read_text())
