"""The K-major ("columnwise") fp8 weight gradient (``relaymoe.kernels.fp8.columns`` and
``wgrad.fp8_wgrad_columnwise``) against the pair-row one (``wgrad.fp8_wgrad``) and float64, on
the Triton interpreter (fp32 outputs).

Both kernels read the same fp8 bytes with the same scales, so they differ by fp32 accumulation
only: each sums an expert's n products ``p`` in fp32, within ``n * 2^-24 * sum|p|`` of the exact
sum (``fp32_bound``), so they agree within twice that, elementwise, and each is within ``ACC``
(relative) of float64. The transposing quantisers are checked bit for bit against the
row-major ones. The sm90 compile (K-major tiles: pipelined) is ``test_fp8_compile.py``'s."""

from __future__ import annotations

import pytest
import torch

from relaymoe.fp8_recipe import Fp8Recipe
from relaymoe.fp8_state import Fp8State
from relaymoe.kernels import interpret_mode
from relaymoe.kernels.fp8.columns import column_layout, write_columns
from relaymoe.kernels.fp8.quantize import quantize_rows
from relaymoe.kernels.fp8.wgrad import fp8_wgrad, fp8_wgrad_columnwise
from relaymoe.options import KernelOptions
from relaymoe.routing import build_routing_index
from tests.fixtures import random_routing, rel_err
from tests.fp8_emulation import RecordedScaling, fp8_emulation, run_layer

pytestmark = pytest.mark.skipif(
    not interpret_mode(), reason="CPU tests run the kernels under TRITON_INTERPRET=1"
)

ACC = 1e-5  # fp32 accumulation of exact fp8 products against float64 (test_fp8_experts.py)
F64 = torch.float64
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _range(t, e, k, kind, e0, e1, seed):
    """The routing index, the range's offsets, its pairs' tokens and local experts."""
    g = torch.Generator().manual_seed(seed)
    index = build_routing_index(random_routing(t, e, k, gen=g, kind=kind), e)
    offs = index.offsets_for(e0, e1)
    lo, hi = int(offs[0]), int(offs[-1])
    counts = (offs[1:] - offs[:-1]).long()
    expert = torch.repeat_interleave(torch.arange(e1 - e0), counts)
    return index, offs, index.expert_token_indices[lo:hi].long(), expert


def _fp8(t, fmt, scale):
    return quantize_rows(t, fmt, scale=torch.tensor([scale]))[0]


def fp32_bound(a_PM, b_PN, expert, n_experts, scale):
    """Elementwise bound of an fp32 sum's error over each expert's pairs: n * 2^-24 * sum|p|."""
    mag = torch.zeros(n_experts, a_PM.shape[1], b_PN.shape[1], dtype=F64)
    mag.index_add_(0, expert, a_PM.abs()[:, :, None] * b_PN.abs()[:, None, :])
    n = torch.bincount(expert, minlength=n_experts).to(F64)[:, None, None]
    return n * 2.0**-24 * mag * scale


CASES = [  # (T, H, C, E, K, routing, expert range)
    (31, 40, 72, 4, 2, "empty", (0, 4)),  # odd sizes, an expert without pairs
    (29, 24, 40, 5, 2, "one", (0, 5)),  # one hot expert (every token's first pick)
    (13, 40, 24, 3, 3, "uniform", (0, 3)),  # top-k = E: every token at every expert
    (37, 72, 40, 6, 2, "skewed", (2, 5)),  # a partial expert range (a ring hop's)
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("accumulate", [False, True])
def test_columnwise_wgrad_equals_rows_wgrad_and_float64(case, accumulate):
    t, h, c, e, k, kind, (e0, e1) = case
    index, offs, tok, expert = _range(t, e, k, kind, e0, e1, seed=t + h)
    n_exp, n_pairs = e1 - e0, tok.shape[0]
    g = torch.Generator().manual_seed(h)
    s_x, s_c = 2.0, 5.0
    xq = _fp8(torch.randn(t, h, generator=g), "e4m3", s_x)  # x: (T, H), gathered
    cq = _fp8(torch.randn(n_pairs, c, generator=g), "e5m2", s_c)  # dh: pair order
    inv_x, inv_c = torch.tensor([1 / s_x]), torch.tensor([1 / s_c])
    layout = column_layout(offs, n_pairs)
    x_cols = torch.empty(h, layout.width, dtype=E4)
    write_columns(xq, layout, x_cols, idx_P=index.expert_token_indices, offs=offs)
    c_cols = torch.empty(c, layout.width, dtype=E5)
    write_columns(cq, layout, c_cols)  # the bytes as they are, pair order
    start = torch.randn(n_exp, c, h, generator=g)
    start[:, 0] = -0.0  # adding a zero sum would turn it into +0.0: "untouched" is bitwise
    rows_dw, cols_dw = start.clone(), start.clone()
    if not accumulate:  # everything written, empty experts included
        rows_dw.fill_(float("nan"))
        cols_dw.fill_(float("nan"))
    fp8_wgrad(cq, inv_c, xq, inv_x, index.expert_token_indices, offs, rows_dw, a_gather=False,
              accumulate=accumulate)  # fmt: skip
    fp8_wgrad_columnwise(c_cols, inv_c, x_cols, inv_x, layout.poffs, cols_dw,
                         accumulate=accumulate)  # fmt: skip
    xd, cd = xq.to(F64)[tok] / s_x, cq.to(F64) / s_c
    ref = torch.zeros(n_exp, c, h, dtype=F64).index_add_(0, expert, cd[:, :, None] * xd[:, None])
    base = start.to(F64) if accumulate else 0.0
    bound = 2 * fp32_bound(cq.to(F64), xq.to(F64)[tok], expert, n_exp, 1 / (s_x * s_c))
    assert ((cols_dw.to(F64) - rows_dw.to(F64)).abs() <= bound + 1e-30).all()
    assert rel_err(cols_dw - base, ref) < ACC and rel_err(rows_dw - base, ref) < ACC
    empty = torch.bincount(expert, minlength=n_exp) == 0
    if accumulate:  # an expert without pairs: its gradient untouched
        assert torch.equal(cols_dw[empty].view(torch.int32), start[empty].view(torch.int32))
        assert torch.equal(rows_dw[empty].view(torch.int32), start[empty].view(torch.int32))
    else:
        assert torch.equal(cols_dw[empty], torch.zeros_like(cols_dw[empty]))
    # the other operand order into a strided view: dw2-like (dy gathered, p*a in pair order)
    dw2_t = torch.full((n_exp, c, h), float("nan"))
    fp8_wgrad_columnwise(x_cols, inv_x, c_cols, inv_c, layout.poffs, dw2_t.transpose(1, 2),
                         accumulate=False)  # fmt: skip
    assert rel_err(dw2_t, ref) < ACC


def test_column_layout_and_transposing_quantisers_are_bitwise_the_row_ones():
    """Padded offsets: each expert's columns a multiple of 16 holding its pairs; the quantised
    columns are the row quantiser's bytes transposed, the copied ones x's bytes, padding 0."""
    t, c = 23, 72
    index, offs, tok, expert = _range(t, 5, 2, "empty", 1, 5, seed=3)
    n_pairs = tok.shape[0] + 3  # a bound above the exact count (max_pairs)
    layout = column_layout(offs, n_pairs)
    counts = (offs[1:] - offs[:-1]).long()
    seg = layout.poffs[1:] - layout.poffs[:-1]
    assert layout.poffs[0] == 0 and (seg % 16 == 0).all() and (seg - counts).lt(16).all()
    assert (seg >= counts).all() and layout.width % 16 == 0
    assert layout.width >= n_pairs + 16 * 4 and layout.poffs[-1] <= layout.width
    cols = torch.cat([layout.poffs[i] + torch.arange(int(counts[i])) for i in range(4)])
    pad = torch.ones(layout.width, dtype=torch.bool)
    pad[cols] = False
    g = torch.Generator().manual_seed(4)
    dh = torch.randn(n_pairs, c, generator=g) * 30.0
    dh[-3:] = float("nan")  # rows past the exact count are never read
    s = torch.tensor([7.0])
    want = quantize_rows(dh[: tok.shape[0]], "e5m2", scale=s)[0].view(torch.uint8)
    out = torch.full((c, layout.width), 0x7F, dtype=torch.uint8).view(E5)
    rows = torch.full((n_pairs, c), 0x7F, dtype=torch.uint8).view(E5)
    write_columns(dh, layout, out, scale=s, fmt="e5m2", rows_out=rows)
    assert torch.equal(rows[: tok.shape[0]].view(torch.uint8), want)
    assert torch.equal(out.view(torch.uint8)[:, cols], want.T)
    assert (out.view(torch.uint8)[:, pad] == 0).all()
    xq = _fp8(torch.randn(t, c, generator=g), "e4m3", 3.0)
    x_cols = torch.full((c, layout.width), 0x7F, dtype=torch.uint8).view(E4)
    write_columns(xq, layout, x_cols, idx_P=index.expert_token_indices, offs=offs)
    assert torch.equal(x_cols.view(torch.uint8)[:, cols], xq.view(torch.uint8)[tok].T)
    assert (x_cols.view(torch.uint8)[:, pad] == 0).all()
    with pytest.raises(ValueError, match="pass scale and fmt"):
        write_columns(dh, layout, out)


def test_moe_experts_fp8_agrees_in_both_wgrad_layouts():
    """The whole tensorwise layer with each layout against its float64 emulation, on the
    kernels' recorded scales (test_fp8_experts.py says why)."""
    g = torch.Generator().manual_seed(11)
    t, h, i, e, k = 21, 40, 24, 4, 2
    x, probs = torch.randn(t, h, generator=g), torch.rand(t, k, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g)
    idx = random_routing(t, e, k, gen=g, kind="empty")
    dy = torch.randn(t, h, generator=g)
    got = {}
    for layout in ("columnwise", "rows"):
        state = Fp8State(Fp8Recipe("tensorwise"))
        state.scales = rec = RecordedScaling(state.scales)
        kernels = KernelOptions(wgrad="gmm", fp8_wgrad_layout=layout)
        got[layout] = run_layer(x, w13, w2, idx, probs, dy, fp8=state, kernels=kernels)
        want = fp8_emulation(x, state.expert_weights(w13, w2), idx, probs, dy, state.recipe,
                             amax=rec.amax)  # fmt: skip
        for name, v in got[layout].items():
            assert rel_err(v, want[name]) < ACC, (layout, name)
    for name in ("out", "dx", "dprobs"):  # the layout changes the weight gradients only
        assert torch.equal(got["columnwise"][name], got["rows"][name]), name
    for name in ("dw13", "dw2"):
        assert rel_err(got["columnwise"][name], got["rows"][name]) < ACC, name
