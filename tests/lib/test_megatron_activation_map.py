"""Megatron's expert MLP options read as one ExpertActivation (relaymoe/megatron/activation_map.py),
the refusals by name, and the experts' bias parameters (expert_weights.py), in-process.

The layer-level proof that each mapping is what Megatron's own experts compute (ring or stand-in
MoELayer against megatron-core's allgather one, weights, biases and gradients) is
tests/lib/test_megatron_expert_mlp.py."""

from __future__ import annotations

import functools
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from relaymoe.activation import ExpertActivation
from tests.fixtures import assert_close, tiny_transformer_config

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def mcore():
    import relaymoe.megatron as rm

    rm.register()
    return rm


def _fns():
    """Megatron's activation functions by name, and the ExpertActivation keywords of each."""
    from megatron.core import activations as A
    from megatron.core.fusions import fused_bias_geglu as G
    from megatron.core.transformer import utils as U

    return [
        (F.silu, dict(fn="silu")),
        (F.gelu, dict(fn="gelu")),
        (F.relu, dict(fn="relu")),
        (A.squared_relu, dict(fn="squared_relu")),
        (A.quick_gelu, dict(fn="silu", alpha=1.702)),
        (G.quick_gelu, dict(fn="silu", alpha=1.702)),
        (A.fast_gelu, dict(fn="gelu_tanh")),
        (U.openai_gelu, dict(fn="gelu_tanh")),
        (U.gelu_impl, dict(fn="gelu_tanh")),
        (U.erf_gelu, dict(fn="gelu")),
    ]


def _view(**kw):
    """A TransformerConfig's fields the mapping reads (Megatron's defaults but for ``kw``)."""
    base = dict(activation_func=F.gelu, gated_linear_unit=False, activation_func_clamp_value=None,
                glu_linear_offset=0.0, bias_activation_fusion=False, use_te_activation_func=False,
                transformer_impl="transformer_engine", moe_grouped_gemm=True,
                add_bias_linear=True)  # fmt: skip
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("gated", [False, True])
def test_every_megatron_function_maps_to_its_activation(mcore, gated):
    """Each function megatron-core builds, gated or not, is the ExpertActivation computing its
    values: Megatron's function (its Python body, uncompiled) against the oracle's."""
    from relaymoe.megatron.activation_map import expert_activation_of, megatron_function_name
    from relaymoe.reference import reference_activation

    x = torch.linspace(-6, 6, 601, dtype=torch.float64)
    for fn, want in _fns():
        act = expert_activation_of(_view(activation_func=fn, gated_linear_unit=gated))
        assert act == ExpertActivation(gated=gated, **want), (fn.__name__, act)
        raw = getattr(fn, "__wrapped__", fn)  # jit_fuser's torch.compile wrapper: the body
        h = torch.cat([x, x.flip(0) * 0.5]) if gated else x
        if gated:  # Megatron's glu(): fn(gate) * linear, [gate; linear] halves
            gate, lin = h.chunk(2)
            want_vals = raw(gate) * lin
        else:
            want_vals = raw(h)
        # erf_gelu writes sqrt(2) as 1.41421: within 2e-6 of the exact erf form
        tol = 3e-6 if fn.__name__ == "erf_gelu" else 1e-7
        assert_close(f"{fn.__name__} gated={gated}", reference_activation(act, h), want_vals, tol)
        assert megatron_function_name(functools.wraps(fn)(lambda t: t)) == megatron_function_name(
            fn
        )  # a wrapper (torch.compile's, functools.wraps) names the function it wraps


def test_clamp_and_offset_map_for_gated_units_as_megatron_applies_them(mcore):
    """GPT-OSS: quick_gelu gated, clamp 7, offset 1 (unfused glu(), TEGroupedMLP's fused kernel
    with the bias inside fc1); any gated function takes them in the unfused path."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from relaymoe.megatron.activation_map import expert_activation_of

    gpt_oss = dict(activation_func=quick_gelu, gated_linear_unit=True,
                   activation_func_clamp_value=7.0, glu_linear_offset=1.0)  # fmt: skip
    want = ExpertActivation(fn="silu", alpha=1.702, limit=7.0, linear_offset=1.0)
    assert expert_activation_of(_view(**gpt_oss)) == want
    assert expert_activation_of(_view(**gpt_oss, bias_activation_fusion=True)) == want
    assert expert_activation_of(_view(**gpt_oss, add_bias_linear=False, transformer_impl="local",
                                      bias_activation_fusion=True)) == want  # fmt: skip
    geglu = _view(gated_linear_unit=True, activation_func_clamp_value=3.0, glu_linear_offset=0.5)
    assert expert_activation_of(geglu) == ExpertActivation(fn="gelu", limit=3.0, linear_offset=0.5)


def test_te_activation_is_the_tanh_gelu(mcore):
    """TransformerEngine's GELU/GEGLU (use_te_activation_func, TE spec) is the tanh form; the
    local spec builds no TE activation, whatever the flag."""
    from relaymoe.megatron.activation_map import expert_activation_of

    for gated in (False, True):
        te = _view(gated_linear_unit=gated, use_te_activation_func=True)
        assert expert_activation_of(te) == ExpertActivation(fn="gelu_tanh", gated=gated)
        local = _view(gated_linear_unit=gated, use_te_activation_func=True,
                      transformer_impl="local")  # fmt: skip
        assert expert_activation_of(local) == ExpertActivation(fn="gelu", gated=gated)
    swiglu = _view(activation_func=F.silu, gated_linear_unit=True, use_te_activation_func=True)
    assert expert_activation_of(swiglu) == ExpertActivation()


REFUSED = [
    (dict(activation_func=torch.tanh), ["activation_func=torch.tanh is not one",
                                        "the ring computes silu/gelu/gelu_tanh/relu/"]),
    (dict(activation_func=lambda t: t), ["activation_func=", "is not one", "--quick-geglu"]),
    (dict(activation_func_clamp_value=7.0), ["activation_func_clamp_value=7.0 on a non-gated",
                                             "fix: remove --activation-func-clamp-value"]),
    (dict(glu_linear_offset=1.0), ["glu_linear_offset=1.0 on a non-gated",
                                   "fix: remove --glu-linear-offset"]),
    (dict(activation_func=F.silu, use_te_activation_func=True),
     ["TEActivationOp builds TransformerEngine's ReLU", "fix: remove --use-te-activation-func"]),
    (dict(activation_func=F.silu, gated_linear_unit=True, use_te_activation_func=True,
          activation_func_clamp_value=7.0),
     ["takes no clamp or offset", "fix: remove --use-te-activation-func or "
                                  "--activation-func-clamp-value"]),
    (dict(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=True,
          activation_func_clamp_value=7.0),
     ["fused SwiGLU ignores the clamp", "fix: bias_activation_fusion=False "
                                        "(--no-bias-swiglu-fusion)"]),
    (dict(activation_func="quick_gelu", gated_linear_unit=True, bias_activation_fusion=True,
          activation_func_clamp_value=7.0, moe_grouped_gemm=False),
     ["clamps fc1's output before adding its bias", "--moe-grouped-gemm"]),
    (dict(activation_func=F.silu, gated_linear_unit=True, activation_func_clamp_value=-1.0),
     ["activation_func_clamp_value=-1.0", "limit=-1.0 must be", "a finite value > 0"]),
]  # fmt: skip


@pytest.mark.parametrize("kw,parts", REFUSED, ids=[p[0] for _, p in REFUSED])
def test_unmappable_expert_mlps_refused_by_name(mcore, kw, parts):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from relaymoe.megatron.activation_map import expert_activation_of, expert_activation_problems

    if kw.get("activation_func") == "quick_gelu":
        kw = {**kw, "activation_func": quick_gelu}
    act, problems = expert_activation_problems(_view(**kw))
    assert act is None and len(problems) == 1, problems
    for part in parts:
        assert part in problems[0], problems[0]
    assert "fix:" in problems[0]
    with pytest.raises(ValueError, match="the ring cannot map this expert MLP"):
        expert_activation_of(_view(**kw))


ARGS = [  # Megatron's flags -> what core_transformer_config_from_args builds
    (dict(), ExpertActivation(fn="gelu", gated=False)),
    (dict(swiglu=True), ExpertActivation()),
    (dict(squared_relu=True), ExpertActivation(fn="squared_relu", gated=False)),
    (dict(quick_geglu=True), ExpertActivation(fn="silu", alpha=1.702)),
    (dict(quick_geglu=True, activation_func_clamp_value=7.0, glu_linear_offset=1.0,
          moe_grouped_gemm=True),  # GPT-OSS's experts (TEGroupedMLP): fused, bias inside fc1
     ExpertActivation(fn="silu", alpha=1.702, limit=7.0, linear_offset=1.0)),
    (dict(quick_geglu=True, activation_func_clamp_value=7.0, add_bias_linear=False),
     ExpertActivation(fn="silu", alpha=1.702, limit=7.0)),  # no bias: no order to get wrong
    (dict(openai_gelu=True), ExpertActivation(fn="gelu", gated=False)),  # 0.19 ignores it
    (dict(use_te_activation_func=True), ExpertActivation(fn="gelu_tanh", gated=False)),
    (dict(use_te_activation_func=True, transformer_impl="local"),
     ExpertActivation(fn="gelu", gated=False)),
]  # fmt: skip


@pytest.mark.parametrize("kw,want", ARGS, ids=[str(a) for _, a in ARGS])
def test_megatron_flags_map_as_megatron_translates_them(kw, want):
    """The parsed arguments, with Megatron's parser defaults for what is not given
    (--add-bias-linear on, the bias fusions on, TransformerEngine, no grouped GEMM)."""
    from relaymoe.megatron.activation_map import expert_activation_problems

    act, problems = expert_activation_problems(types.SimpleNamespace(**kw), args_style=True)
    assert problems == [] and act == want, (act, problems)


def test_megatron_flags_refused_by_flag():
    from relaymoe.megatron.activation_map import expert_activation_problems

    def problems(**kw):
        return expert_activation_problems(types.SimpleNamespace(**kw), args_style=True)[1]

    (p,) = problems(swiglu=True, squared_relu=True)
    assert "--swiglu with --squared-relu" in p and "fix: keep one" in p
    # the default local/SequentialMLP quick-GeGLU with biases: the fusion clamps before the bias
    (p,) = problems(quick_geglu=True, activation_func_clamp_value=7.0, transformer_impl="local")
    assert "fix: --no-bias-gelu-fusion" in p
    assert problems(quick_geglu=True, activation_func_clamp_value=7.0, transformer_impl="local",
                    bias_gelu_fusion=False) == []  # fmt: skip
    (p,) = problems(swiglu=True, activation_func_clamp_value=7.0)
    assert "fix: --no-bias-swiglu-fusion" in p


def test_ring_config_problems_name_the_activation_for_configs_and_args(mcore):
    """validate.py reports the mapping's problems among its own, in both styles, and accepts
    every Megatron expert MLP the ring computes."""
    from megatron.core.activations import squared_relu

    from relaymoe.megatron.validate import ring_config_problems

    base = dict(expert_model_parallel_size=2, moe_token_dispatcher_type="ring")
    for kw in (dict(gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True),
               dict(gated_linear_unit=False, activation_func=squared_relu, add_bias_linear=True),
               dict(activation_func=F.gelu, add_bias_linear=True)):  # fmt: skip
        assert ring_config_problems(tiny_transformer_config(**base, **kw)) == []
    ns = types.SimpleNamespace(moe_token_dispatcher_type="ring", swiglu=True, squared_relu=True)
    assert any("--swiglu with --squared-relu" in p
               for p in ring_config_problems(ns, args_style=True))  # fmt: skip


# ------------------------------------------------------------------------- the experts' biases
class _GroupedLinear(torch.nn.Module):
    """TransformerEngine GroupedLinear's parameter layout: weight{j}, and bias{j} parameters with
    bias, an empty plain tensor each without (what TE sets)."""

    def __init__(self, n, out, inp, bias: bool):
        super().__init__()
        g = torch.Generator().manual_seed(out)
        for j in range(n):
            w = torch.nn.Parameter(torch.randn(out, inp, generator=g))
            self.register_parameter(f"weight{j}", w)
            if bias:
                self.register_parameter(f"bias{j}", torch.nn.Parameter(torch.randn(out)))
            else:
                setattr(self, f"bias{j}", torch.Tensor())


class _TEGroupedMLP(torch.nn.Module):
    def __init__(self, n, gated: bool, bias: bool, h=6, i=4):
        super().__init__()
        self.num_local_experts = n
        self.linear_fc1 = _GroupedLinear(n, (2 if gated else 1) * i, h, bias)
        self.linear_fc2 = _GroupedLinear(n, h, i, bias)


class _Linear(torch.nn.Module):
    def __init__(self, out, inp, bias: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out, inp))
        self.bias = torch.nn.Parameter(torch.randn(out)) if bias else None  # Megatron: None


class _Expert(torch.nn.Module):
    def __init__(self, bias: bool, h=6, i=4):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = _Linear(i, h, bias), _Linear(h, i, bias)


class _SequentialMLP(torch.nn.Module):
    def __init__(self, biases):
        super().__init__()
        self.local_experts = torch.nn.ModuleList(_Expert(b) for b in biases)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_expert_biases_are_the_parameters_themselves(gated, bias):
    from relaymoe.megatron.expert_weights import expert_bias_lists, expert_param_lists

    te = _TEGroupedMLP(3, gated, bias)
    fc1, fc2 = expert_param_lists(te)
    assert [tuple(w.shape) for w in fc1] == [((2 if gated else 1) * 4, 6)] * 3
    b13, b2 = expert_bias_lists(te)
    seq = _SequentialMLP([bias] * 2)
    s13, s2 = expert_bias_lists(seq)
    if not bias:
        assert (b13, b2, s13, s2) == (None, None, None, None)
        return
    assert all(b is getattr(te.linear_fc1, f"bias{j}") for j, b in enumerate(b13))
    assert all(b is getattr(te.linear_fc2, f"bias{j}") for j, b in enumerate(b2))
    assert [tuple(b.shape) for b in b13] == [(fc1[0].shape[0],)] * 3
    assert all(b is e.linear_fc1.bias for b, e in zip(s13, seq.local_experts, strict=True))
    assert all(b is e.linear_fc2.bias for b, e in zip(s2, seq.local_experts, strict=True))


def test_experts_with_and_without_biases_refused():
    from relaymoe.megatron.expert_weights import expert_bias_lists

    with pytest.raises(ValueError, match="1 of 2 experts have a fc1 bias.*--add-bias-linear"):
        expert_bias_lists(_SequentialMLP([True, False]))
