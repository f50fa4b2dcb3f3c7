"""fp8 quantisation: the recipes, the torch quantisers against their definition (exact round
trips, the error bound of a rounding, scales from amax), the Triton quantisers against the torch
ones bit for bit (interpreter), and delayed scaling's history.
"""

from __future__ import annotations

import pytest
import torch

from relaymoe.fp8_recipe import Fp8Recipe, as_fp8_recipe
from relaymoe.kernels import interpret_mode
from relaymoe.kernels.fp8 import quant_torch as qt
from relaymoe.kernels.fp8.scaling import CurrentScaling, DelayedScaling

# relative spacing of values in the normal range: 2^-3 (e4m3) and 2^-2 (e5m2); a rounding to
# nearest is off by at most half of it
HALF_ULP = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
MIN_NORMAL = {"e4m3": 2.0**-6, "e5m2": 2.0**-14}


def test_recipes_by_te_names_and_defaults():
    assert as_fp8_recipe(None) is None
    tw, dl, bw = (as_fp8_recipe(n) for n in ("tensorwise", "delayed", "blockwise"))
    assert (tw.fmt, dl.fmt, bw.fmt) == ("hybrid", "hybrid", "e4m3")  # TE's defaults
    assert tw.grad_format == "e5m2" and bw.grad_format == "e4m3"
    assert not tw.power_2_scales and bw.power_2_scales
    assert tw.gemms_in_fp8() == {"fprop": True, "dgrad": True, "wgrad": True}
    assert bw.gemms_in_fp8() == {"fprop": True, "dgrad": True, "wgrad": False}
    assert Fp8Recipe("tensorwise", fp8_wgrad=False).gemms_in_fp8()["wgrad"] is False
    assert as_fp8_recipe(bw) is bw and hash(bw) == hash(Fp8Recipe("blockwise"))
    for bad, match in [({"recipe": "mxfp8"}, "Blackwell"), ({"fmt": "e5m2"}, "format"),
                       ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
                       ({"amax_history_len": 0}, "amax_history_len"), ({"margin": -1}, "margin"),
                       ({"recipe": "blockwise", "fp8_wgrad": True}, "T\\*K"),
                       ({"power_2_scales": True}, "blockwise")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            Fp8Recipe(**bad)
    with pytest.raises(ValueError, match="recipe name"):
        as_fp8_recipe(8)


def test_scale_from_amax_edges():
    amax = torch.tensor([0.0, 448.0, 1.0, 3.0, 1e-45, float("inf")])
    s = qt.scale_from_amax(amax, "e4m3")
    assert s[0] == 1.0 and s[1] == 1.0 and s[2] == 448.0 and s[5] == 1.0
    assert s[3] == torch.tensor(448.0) / 3.0
    assert s[4] == torch.finfo(torch.float32).max  # the overflow to inf
    p2 = qt.scale_from_amax(amax, "e4m3", pow2=True)
    assert p2[2] == 256.0 and p2[3] == 128.0 and p2[4] == 2.0**127  # rounded down
    assert qt.scale_from_amax(torch.tensor(1.0), "e5m2", margin=2) == 57344.0 / 4


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_is_exact_on_fp8_values_and_within_half_an_ulp(fmt):
    dtype = qt.fp8_dtype(fmt)
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    every = every[torch.isfinite(every)]
    one = torch.ones(())
    assert torch.equal(qt.quantize_with(every, one, fmt).float(), every)  # exact round trip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-3, 2, 4096)
    s = qt.scale_from_amax(x.abs().amax(), fmt)
    back = qt.quantize_with(x, s, fmt).float() * (1.0 / s)
    normal = (x * s).abs() >= MIN_NORMAL[fmt]
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= HALF_ULP[fmt] * (1 + 1e-6)
    # below the normal range the spacing is absolute: half of the least subnormal
    sub = (back - x).abs()[~normal] * s
    assert torch.all(sub <= MIN_NORMAL[fmt] * 2.0 ** -(3 if fmt == "e4m3" else 2) / 2 * (1 + 1e-6))
    big = torch.tensor([1e9, -1e9])  # clamped (saturating), never inf or NaN
    assert torch.equal(qt.quantize_with(big, one, fmt).float(), torch.tensor([1.0, -1.0]) * (
        qt.FP8_MAX[fmt]))  # fmt: skip


def test_row_and_block_quantisation_scale_each_block_by_its_own_amax():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 300, generator=g)
    x[1, 128:256] *= 1000.0  # one loud block does not change its neighbours' scales
    x[2] = 0.0
    q, inv = qt.quantize_rows(x, "e4m3")
    assert q.shape == x.shape and inv.shape == (5, 3)
    amax = torch.stack([x[:, 0:128].abs().amax(1), x[:, 128:256].abs().amax(1),
                        x[:, 256:].abs().amax(1)], 1)  # fmt: skip
    want = 1.0 / qt.scale_from_amax(amax, "e4m3", pow2=True)
    assert torch.equal(inv, want) and torch.all(inv[2] == 1.0)
    inv_x = inv.repeat_interleave(128, 1)[:, :300]  # half an ulp, relative, or subnormal
    assert torch.all((qt.dequantize_rows(q, inv) - x).abs() <= 2**-4 * x.abs() + 2**-10 * inv_x)
    w = torch.randn(3, 200, 130, generator=g)
    wq, winv = qt.quantize_blocks(w, "e4m3")
    assert winv.shape == (3, 2, 2)
    assert torch.equal(winv[1, 1, 0], 1.0 / qt.scale_from_amax(w[1, 128:, :128].abs().amax(),
                                                               "e4m3", pow2=True))  # fmt: skip
    assert (qt.dequantize_blocks(wq, winv) - w).abs().max() <= (w.abs().max() * 2**-4)


pytestmark_interp = pytest.mark.skipif(
    not interpret_mode(), reason="the Triton quantisers run under TRITON_INTERPRET=1 on CPU"
)


@pytestmark_interp
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_triton_row_quantiser_matches_torch_bit_for_bit(fmt):
    from relaymoe.kernels.fp8.quantize import quantize_rows

    g = torch.Generator().manual_seed(2)
    x = torch.randn(19, 300, generator=g) * torch.logspace(-9, 4, 300)
    x[3] = 0.0
    x[4, :7] = torch.tensor([1e9, -1e9, 2.0**-12, 17.0, 18.0, -19.0, 0.1])  # clamp, ties, tiny
    got_q, got_inv = quantize_rows(x, fmt)
    want_q, want_inv = qt.quantize_rows(x, fmt)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_inv, want_inv)
    s = qt.scale_from_amax(x.abs().amax(), fmt).reshape(1)
    got_t, _ = quantize_rows(x, fmt, scale=s)
    assert torch.equal(got_t.view(torch.uint8), qt.quantize_with(x, s, fmt).view(torch.uint8))


def test_current_and_delayed_scaling():
    cur = CurrentScaling()
    assert cur.scale("x", torch.tensor(2.0), "e4m3").item() == 224.0
    d = DelayedScaling(history_len=3, algo="max")
    amaxes = [4.0, 1.0, 2.0, 0.5, 0.25]
    used = [d.scale("x", torch.tensor(a), "e4m3").item() for a in amaxes]
    # first call: TE's initial scale 1; then fmax / max of the last 3 amaxes before the call
    assert used == [1.0, 112.0, 112.0, 112.0, 224.0]
    assert torch.equal(d.history["x"], torch.tensor([0.25, 0.5, 2.0]))
    recent = DelayedScaling(history_len=4, algo="most_recent")
    seen = [recent.scale("dy", torch.tensor(a), "e5m2").item() for a in (8.0, 1.0)]
    assert seen == [1.0, 57344.0 / 8]
    other = DelayedScaling(history_len=4, algo="max")
    other.load_state_dict(recent.state_dict())
    assert other.scale("dy", torch.tensor(3.0), "e5m2").item() == 57344.0  # most recent: 1.0


@pytestmark_interp
@pytest.mark.parametrize(
    "recipe,shape", [("tensorwise", (3, 40, 72)), ("blockwise", (2, 256, 384))]
)
def test_weights_quantiser_matches_torch_in_both_layouts(recipe, shape):
    from relaymoe.kernels.fp8.weights import quantize_expert_weights

    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(*shape, generator=g)
    w13[0, :, : shape[2] // 2] *= 50.0  # experts and blocks of other scales
    w2 = torch.randn(shape[0], shape[2], shape[1] // 2, generator=g)
    got = quantize_expert_weights(w13, w2, Fp8Recipe(recipe))
    for q, q_t, inv, w in ((got.w13, got.w13_t, got.inv13, w13), (got.w2, got.w2_t, got.inv2, w2)):
        if recipe == "blockwise":
            want_q, want_inv = qt.quantize_blocks(w, "e4m3")
        else:
            s = qt.scale_from_amax(w.abs().amax(dim=(1, 2)), "e4m3")
            want_q, want_inv = qt.quantize_with(w, s[:, None, None], "e4m3"), 1.0 / s
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(q_t, q.transpose(1, 2)) and q_t.is_contiguous()
        assert torch.equal(inv, want_inv)
