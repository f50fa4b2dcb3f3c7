"""Large offsets (issue #17 item 5): where an int32 offset remains (token ids in the routing
index, the pair rows of one expert range, offsets inside one expert's weight, the launch grid),
the sizes are checked before anything is allocated or launched, and the ``ValueError`` names the
value, the 2^31 limit and the fix. Sizes are described, not allocated: plain integers, tensors
on the ``meta`` device, or zero-stride expanded views.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.kernels import INT32_LIMIT, check_problem_limits
from relaymoe.options import RingConfig
from relaymoe.routing import build_routing_index

LIMIT = 2**31


def _limits(**kw):
    sizes = dict(tokens=4096, topk=8, hidden=2048, ffn=768, num_local_experts=64)
    sizes.update(kw)
    check_problem_limits(**sizes, where="test")


def test_limit_is_two_to_the_31():
    assert INT32_LIMIT == LIMIT == torch.iinfo(torch.int32).max + 1


@pytest.mark.parametrize(
    "sizes, what, fix",
    [
        (dict(tokens=LIMIT, topk=1), "T (tokens of one partition) = 2,147,483,648", "split"),
        # pairs of one expert range: T * min(K, E_local)
        (dict(tokens=2**30, topk=2, num_local_experts=4), "T*min(K, E_local) = 1073741824*2",
         "fewer experts per rank"),
        (dict(tokens=2**29, topk=8, num_local_experts=4), "T*min(K, E_local) = 536870912*4",
         "fewer tokens per call"),
        # one expert's fc1 weight: 2*I*H elements
        (dict(ffn=2**15, hidden=2**15), "2*I*H = 2*32768*32768", "shard the expert FFN"),
    ],
)  # fmt: skip
def test_problem_limits_name_the_value_the_limit_and_the_fix(sizes, what, fix):
    with pytest.raises(ValueError) as info:
        _limits(**sizes)
    msg = str(info.value)
    assert what in msg and "2^31 = 2,147,483,648" in msg and fix in msg, msg


@pytest.mark.parametrize(
    "sizes",
    [
        dict(tokens=LIMIT - 1, topk=1, num_local_experts=1),
        dict(tokens=2**30 - 1, topk=2, num_local_experts=8),
        dict(tokens=2**30, topk=8, num_local_experts=1),  # one expert per rank: one pair a token
        dict(ffn=2**15, hidden=2**15 - 1),
        dict(tokens=2**20, topk=8, hidden=8192, ffn=2048, num_local_experts=256),  # T*K*H > 2^31
    ],
)
def test_sizes_just_under_the_limits_pass(sizes):
    _limits(**sizes)


def test_ring_moe_refuses_before_allocating_anything():
    """T = 2^31 tokens described by zero-stride views: the agreement refuses (every rank would
    raise the same error) before a routing index or a buffer exists."""
    from relaymoe.ring import ring_moe

    T, H, I, El, K = LIMIT, 8, 4, 2, 2
    x = torch.zeros(1, H).expand(T, H)
    idx = torch.tensor([[0, 1]]).expand(T, K)
    probs = torch.ones(1, K).expand(T, K)
    w13, w2 = torch.zeros(El, 2 * I, H), torch.zeros(El, H, I)
    for mode in ("expert", "token", "alltoall"):
        with pytest.raises(ValueError, match=r"ring_moe \(mode='.*'.*T \(tokens of one partition"):
            ring_moe(x, w13, w2, idx, probs, trusted=True, config=RingConfig(mode=mode))


def _meta(shape, stride=None):
    if stride is None:
        return torch.empty(shape, device="meta")
    return torch.empty_strided(shape, stride, device="meta")


def test_kernel_launchers_check_their_int32_offsets():
    pytest.importorskip("triton")
    from relaymoe.kernels import grouped
    from relaymoe.kernels.routing import build_routing_index_triton

    # the SwiGLU backward's row ids are int32
    g = _meta((LIMIT, 4))
    with pytest.raises(ValueError, match="pair rows of the expert range.*2\\^31"):
        grouped.swiglu_backward(g, g, _meta((LIMIT,)), g, _meta((LIMIT,)))
    # offsets inside one expert's weight: w13 (E, 2I, H) with 2I*H = 2^31
    w13 = _meta((2, 2**16, 2**15))
    offs = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="inside one expert of w13.*shard the expert FFN"):
        grouped.up_swiglu(_meta((4, 2**15)), w13, None, offs, None, None, _meta((4, 2**15)))
    # a strided view: the span counts the strides, not the element count
    b = _meta((1, 2, 2), (8, LIMIT, 1))
    with pytest.raises(ValueError, match="inside one expert of the weight operand"):
        grouped.rows_gemm(_meta((4, 2)), b, offs[:2], _meta((4, 2)))
    with pytest.raises(ValueError, match="inside one expert of the weight gradient"):
        grouped.wgrad(None, None, None, offs, _meta((2, 2**16, 2**15)), a_gather=True,
                      b_gather=False, accumulate=False)  # fmt: skip
    # token ids in the routing index are int32
    with pytest.raises(ValueError, match="T \\(tokens\\) = 2,147,483,648"):
        build_routing_index_triton(_meta((LIMIT, 1), (0, 1)).to(torch.int64), 8)


def test_kernel_checks_pass_just_under_the_limits():
    pytest.importorskip("triton")
    from relaymoe.kernels import experts as kexperts
    from relaymoe.kernels import grouped

    grouped.tiles.check_rows(LIMIT - 1, "test")
    grouped.tiles.check_expert_span(_meta((2, 2**16, 2**15 - 1)), "w13", "test")
    kexperts.check_hop_sizes(LIMIT - 1, LIMIT - 1, "test")
    with pytest.raises(ValueError, match="pairs of the expert range"):
        kexperts.check_hop_sizes(10, LIMIT, "test")
    # the row kernels' grid: tiles of the pairs times tiles of the columns
    grid = grouped.tiles.row_grid(2**30, 4, 2**12)
    assert grid({"BLOCK_M": 128, "BLOCK_N": 128}) == ((2**23 + 4) * 32,)
    with pytest.raises(ValueError, match="launch grid"):
        grid({"BLOCK_M": 16, "BLOCK_N": 16})


def test_routing_index_refuses_token_ids_past_int32():
    # a shape-only (meta) tensor: nothing is allocated
    idx = torch.empty((2**31, 1), dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"tokens T = 2,147,483,648 reaches the int32 limit"):
        build_routing_index(idx, 4, impl="torch", validate=False)
