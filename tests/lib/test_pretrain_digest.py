"""The pretrain entry point's weight digest (what the GPU determinism harness compares) and its
flag, on CPU: what the digest can tell apart."""

from __future__ import annotations

import argparse

import torch

from relaymoe.megatron.pretrain import extra_args, weights_digest


def _modules(seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(5, 3).to(torch.bfloat16), torch.nn.Sequential(torch.nn.Linear(3, 2))]


def test_weights_digest_sees_one_bit_a_dtype_and_the_order():
    ref, count = weights_digest(_modules())
    assert count == 4 and ref == weights_digest(_modules())[0]  # same values, same digest
    mods = _modules()
    with torch.no_grad():
        flat = mods[0].weight.view(torch.int16).view(-1)
        flat[3] ^= 1  # one bit of one bf16 weight
    assert weights_digest(mods)[0] != ref
    mods = _modules()
    mods[1].float().double()  # same values, another dtype
    assert weights_digest(mods)[0] != ref
    assert weights_digest(list(reversed(_modules())))[0] != ref


def test_pretrain_parses_the_digest_flag():
    a = extra_args(argparse.ArgumentParser()).parse_args(
        ["--relaymoe-report", "r.jsonl", "--relaymoe-weights-digest"]
    )
    assert a.relaymoe_report == "r.jsonl" and a.relaymoe_weights_digest is True
