"""relaymoe.lossmodel's default chunk (pure Python): each mode's budget at each impl's bytes a
logit, at issue #53's shape (V 151,936, H 4,096, T 64k) and at the edges."""

from __future__ import annotations

import pytest

from relaymoe import lossmodel
from relaymoe.lossmodel import default_chunk_tokens, fused_loss_bytes, logit_bytes

T64K, H4K, V152K = 65536, 4096, 151936
MiB = 2**20


def test_bytes_a_logit_of_each_impl():
    """Triton: the logits in the activations' dtype; torch: those and an fp32 working copy
    (fp64 for fp64 activations)."""
    assert [logit_bytes("triton", b) for b in (2, 4, 8)] == [2, 4, 8]
    assert [logit_bytes("torch", b) for b in (2, 4, 8)] == [6, 8, 16]
    with pytest.raises(ValueError, match="impl='auto'; use one of"):
        logit_bytes("auto")
    with pytest.raises(ValueError, match="act_bytes=1; use 2, 4 or 8"):
        logit_bytes("triton", 1)


@pytest.mark.parametrize("wgrad", ["accumulate", "recompute"])
def test_accumulating_modes_keep_the_chunk_within_512_mib(wgrad):
    """The weight gradient into an accumulator: the chunk is the whole transient, within 512
    MiB for the impl that runs, the largest multiple of 128 tokens that fits."""
    budget = lossmodel.ACCUMULATE_CHUNK_BUDGET_BYTES
    assert budget == 512 * MiB
    for impl, want in (("triton", 1664), ("torch", 512)):
        c = default_chunk_tokens(T64K, V152K, wgrad=wgrad, impl=impl)
        assert c == want, (impl, c)
        per = logit_bytes(impl)
        assert c * V152K * per <= budget < (c + lossmodel.CHUNK_QUANTUM) * V152K * per
        model = fused_loss_bytes(T64K, H4K, V152K, wgrad=wgrad, impl=impl)
        assert model.chunk == c * V152K * per <= budget
    # issue #53's figure: the accumulate mode's transient on Triton, within 512 MiB
    acc = fused_loss_bytes(T64K, H4K, V152K, wgrad="accumulate", impl="triton")
    assert acc.transient <= budget and round(acc.transient / MiB, 1) == 482.2
    # fp32 activations: 4-byte logits on Triton, half the tokens (a multiple of 128)
    assert default_chunk_tokens(T64K, V152K, wgrad=wgrad, impl="triton", act_bytes=4) == 768


def test_kept_mode_keeps_its_chunk_on_either_impl():
    """The default mode's transient is mostly its fp32 weight gradient: its chunk is sized for
    time, 2 GiB at the torch path's bytes a logit, the same tokens on both impls."""
    for impl in lossmodel.IMPLS:
        assert default_chunk_tokens(T64K, V152K, impl=impl) == 2304
        assert default_chunk_tokens(T64K, V152K, wgrad="kept", impl=impl, act_bytes=4) == 1664
    kept = fused_loss_bytes(T64K, H4K, V152K, impl="triton")
    assert kept.chunk == 2304 * V152K * 2 and kept.dweight == V152K * H4K * 4 > 3 * kept.chunk


def test_default_chunk_edges():
    """At most T (one chunk), 1 for no tokens, at least one quantum for a huge vocabulary;
    bad arguments name themselves."""
    for wgrad in lossmodel.WGRAD_MODES:
        assert default_chunk_tokens(300, V152K, wgrad=wgrad, impl="triton") == 300
        assert default_chunk_tokens(0, V152K, wgrad=wgrad) == 1
        assert default_chunk_tokens(T64K, 2**31, wgrad=wgrad) == lossmodel.CHUNK_QUANTUM
    with pytest.raises(ValueError, match="wgrad='fp32'; use one of"):
        default_chunk_tokens(T64K, V152K, wgrad="fp32")
    with pytest.raises(ValueError, match="impl='cuda'; use one of"):
        default_chunk_tokens(T64K, V152K, wgrad="accumulate", impl="cuda")
    with pytest.raises(ValueError, match="tokens=-1 must be >= 0"):
        default_chunk_tokens(-1, V152K)
    # the model and the op agree on a caller's chunk
    assert fused_loss_bytes(T64K, H4K, V152K, chunk_tokens=1000, impl="triton").chunk == (
        1000 * V152K * 2
    )
