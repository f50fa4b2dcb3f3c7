import torch
import torch.nn.functional as F

from relaymoe.reference import moe_experts_reference
from tests.fixtures import random_problem


def _per_token_loop(x, w13, w2, idx, probs):
    """The semantics written out token by token, pair by pair."""
    ffn = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            gate = w13[e, :ffn] @ x[t]
            up = w13[e, ffn:] @ x[t]
            out[t] += probs[t, k] * (w2[e] @ (F.silu(gate) * up))
    return out


def test_oracle_matches_token_loop():
    gen = torch.Generator().manual_seed(1)
    for kind, (t, e, k) in [("uniform", (13, 5, 2)), ("skewed", (17, 7, 3)), ("one", (9, 4, 1))]:
        x, w13, w2, idx, probs = random_problem(t, 6, 5, e, k, gen=gen, kind=kind)
        torch.testing.assert_close(
            moe_experts_reference(x, w13, w2, idx, probs),
            _per_token_loop(x, w13, w2, idx, probs),
            rtol=1e-12,
            atol=1e-12,
        )


def test_oracle_gradients_match_token_loop():
    gen = torch.Generator().manual_seed(2)
    x, w13, w2, idx, probs = random_problem(11, 4, 3, 5, 5, gen=gen)  # K = E
    ins = [t.requires_grad_() for t in (x, w13, w2, probs)]
    g = torch.randn(11, 4, generator=gen, dtype=torch.float64)
    grads_a = torch.autograd.grad((moe_experts_reference(*ins[:3], idx, ins[3]) * g).sum(), ins)
    grads_b = torch.autograd.grad((_per_token_loop(*ins[:3], idx, ins[3]) * g).sum(), ins)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_oracle_empty_tokens():
    x, w13, w2, idx, probs = random_problem(0, 4, 3, 5, 2)
    assert moe_experts_reference(x, w13, w2, idx, probs).shape == (0, 4)
