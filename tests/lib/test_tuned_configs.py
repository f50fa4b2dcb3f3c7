"""The shipped kernel configurations (relaymoe/kernels/tuned.py) and how the launchers use them."""

from __future__ import annotations

import json

import pytest
import torch

from relaymoe import options
from relaymoe.kernels import grouped, tuned
from tests.fixtures import use_env


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A tuned-configuration table in a temp file, installed as the shipped one."""

    def install(content) -> None:
        path = tmp_path / "tuned_configs.json"
        path.write_text(json.dumps(content))
        monkeypatch.setattr(tuned, "TABLE", path)
        tuned.load_table.cache_clear()
        tuned._lookup.cache_clear()

    yield install
    tuned.load_table.cache_clear()
    tuned._lookup.cache_clear()


CFG = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 5}


def test_buckets_round_sizes_up_to_powers_of_two_and_name_the_dtype():
    key = {"H": 2048, "I": 768, "n_experts": 64, "SAVE_H": True, "SCALE": False}
    assert (
        tuned.bucket(key, torch.bfloat16) == "H=2048,I=1024,n_experts=64,SAVE_H=1,SCALE=0,bfloat16"
    )
    assert tuned.bucket({"M": 1, "N": 1025}, "float32") == "M=1,N=2048,float32"
    # sizes within a factor of two share a bucket; the dtype separates
    assert tuned.bucket({"N": 700}, torch.float16) == tuned.bucket({"N": 1024}, torch.float16)
    assert tuned.bucket({"N": 1024}, torch.float16) != tuned.bucket({"N": 1024}, torch.bfloat16)


def test_shipped_config_by_gpu_kernel_and_bucket(table):
    key = {"N": 768, "K": 2048, "n_experts": 64, "A_GATHER": False}
    b = tuned.bucket(key, torch.bfloat16)
    table({"version": 1, "gpus": {"NVIDIA H200": {"rows_gemm": {b: CFG}}}})
    assert tuned.shipped_config("rows_gemm", key, torch.bfloat16, gpu="NVIDIA H200") == CFG
    assert tuned.shipped_config("rows_gemm", key, torch.float16, gpu="NVIDIA H200") is None
    assert tuned.shipped_config("wgrad", key, torch.bfloat16, gpu="NVIDIA H200") is None
    assert tuned.shipped_config("rows_gemm", key, torch.bfloat16, gpu="NVIDIA H100") is None
    got = tuned.shipped_config("rows_gemm", key, torch.bfloat16, gpu="NVIDIA H200")
    got["BLOCK_M"] = 1  # a copy: the table itself is never changed by a caller
    assert tuned.shipped_config("rows_gemm", key, torch.bfloat16, gpu="NVIDIA H200") == CFG


def test_bad_tables_and_modes_are_refused_by_name(table, monkeypatch):
    table({"version": 7, "gpus": {}})
    with pytest.raises(ValueError, match="not a version-1 tuned-configuration table"):
        tuned.load_table()
    table({"version": 1, "gpus": {"G": {"wgrad": {"b": {"BLOCK_M": 64}}}}})
    with pytest.raises(ValueError, match=r"G / wgrad / b has keys \['BLOCK_M'\]"):
        tuned.load_table()
    table({"version": 1, "gpus": {"G": {"wgrad": {"b": {**CFG, "SPLIT_K": 2}}}}})
    with pytest.raises(ValueError, match=r"may add \['PRELOAD_C'\]"):  # a switch no kernel has
        tuned.load_table()
    table({"version": 1, "gpus": {"G": {"wgrad": {"b": {**CFG, "PRELOAD_C": True}}}}})
    assert tuned.load_table()["gpus"]["G"]["wgrad"]["b"]["PRELOAD_C"] is True
    with pytest.raises(ValueError, match="RELAYMOE_AUTOTUNE='sometimes'"):
        use_env(monkeypatch, RELAYMOE_AUTOTUNE="sometimes")


def test_the_package_ships_a_valid_table():
    tuned.load_table.cache_clear()
    t = tuned.load_table()
    assert t["version"] == tuned.VERSION and isinstance(t["gpus"], dict)


def test_launcher_keys_are_the_autotuners_keys():
    for kernel, names in grouped.TUNED_KERNELS.values():
        assert list(kernel.keys) == list(names)


def test_pick_uses_the_shipped_config_then_the_autotuner(monkeypatch):
    """On a GPU (interpreter off): a shipped config skips the search; without one the autotuner
    runs; ``autotune="search"`` (RELAYMOE_AUTOTUNE=1) always searches, ``"first"`` (=0) takes the
    first candidate."""
    monkeypatch.setattr(grouped.configs, "interpret_mode", lambda: False)
    found = {}
    monkeypatch.setattr(grouped.configs, "shipped_config", lambda name, key, dtype: found.get(name))
    key = {"N": 768, "K": 2048, "n_experts": 64, "A_GATHER": True}
    raw, auto = grouped.rows._rows_gemm_kernel, grouped.rows.rows_tuned

    def pick():
        k = options.from_env().kernels  # the environment use_env set, as an entry point reads it
        return grouped.configs.pick_config(
            auto, raw, None, 2048, "rows_gemm", key, torch.bfloat16, k
        )

    use_env(monkeypatch, RELAYMOE_AUTOTUNE=None)
    assert pick() == (auto, {})  # nothing shipped: search
    found["rows_gemm"] = dict(CFG)
    kernel, meta = pick()
    assert kernel is raw and meta == {**CFG, "EVEN_K": True}
    found["rows_gemm"] = {**CFG, "BLOCK_K": 96}  # 2048 % 96 != 0
    assert pick()[1]["EVEN_K"] is False
    # the weight gradient's candidates may read the output tile first: the switch is passed on
    wkey = {"M": 768, "N": 2048, "A_GATHER": True, "B_GATHER": False, "ACCUMULATE": True,
            "PAIRS": 256}  # fmt: skip
    found["wgrad"] = {**CFG, "PRELOAD_C": True}
    kernel, meta = grouped.configs.pick_config(
        grouped.weight_grads.wgrad_tuned, grouped.weight_grads._wgrad_kernel, None, None,
        "wgrad", wkey, torch.bfloat16, options.from_env().kernels,
    )  # fmt: skip
    assert kernel is grouped.weight_grads._wgrad_kernel and meta == {**CFG, "PRELOAD_C": True}
    assert any(c.kwargs.get("PRELOAD_C") for c in grouped.weight_grads.wgrad_tuned.configs)
    use_env(monkeypatch, RELAYMOE_AUTOTUNE="1")
    assert pick() == (auto, {})
    use_env(monkeypatch, RELAYMOE_AUTOTUNE="0")
    first = auto.configs[0]
    kernel, meta = pick()
    assert kernel is raw and meta["BLOCK_M"] == first.kwargs["BLOCK_M"]
    assert meta["num_warps"] == first.num_warps and meta["num_stages"] == first.num_stages


def test_the_ungated_up_projection_takes_its_own_config_or_the_gated_one_twice_as_wide(
    monkeypatch,
):
    """Without a gate the up-projection has one accumulator a tile: its candidates are the gated
    ones with BLOCK_N doubled, and with shipped configurations it takes a shipped ``up_single``
    entry, else the gated kernel's entry for the same key with BLOCK_N doubled (one tile then
    holds as many outputs, registers and x reuse as the gated tile's two halves). A passed config,
    the search and the interpreter are left alone."""
    up = grouped.up
    assert [c.kwargs["BLOCK_N"] for c in up.UP_SINGLE_CONFIGS] == [
        2 * c.kwargs["BLOCK_N"] for c in grouped.configs.UP_CONFIGS]  # fmt: skip

    def rest(configs):
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
                for c in configs]  # fmt: skip

    assert rest(up.UP_SINGLE_CONFIGS) == rest(grouped.configs.UP_CONFIGS)
    assert grouped.TUNED_KERNELS["up_single"][0] is up.up_single_tuned
    found = {}
    monkeypatch.setattr(up, "shipped_config", lambda name, key, dtype: found.get(name))
    monkeypatch.setattr(up, "interpret_mode", lambda: False)
    key = {"H": 2048, "I": 768, "n_experts": 128, "SAVE_H": False, "SCALE": True}
    k = options.KernelOptions()

    def cfg(config=None, kern=k):
        return up._single_config(config, key, torch.bfloat16, kern)

    assert cfg() is None  # nothing shipped: the single-tile autotuner
    found["up_swiglu"] = dict(CFG)
    assert cfg() == {**CFG, "BLOCK_N": 2 * CFG["BLOCK_N"]}
    found["up_single"] = {**CFG, "BLOCK_M": 256}
    assert cfg() == {**CFG, "BLOCK_M": 256}
    assert cfg({"BLOCK_M": 16}) == {"BLOCK_M": 16}
    search = options.KernelOptions(autotune="search")
    assert cfg(kern=search) is None
    monkeypatch.setattr(up, "interpret_mode", lambda: True)
    assert cfg() is None


def test_the_weight_gradients_key_carries_the_mean_pairs_an_expert(monkeypatch):
    """The weight gradient's best tile depends on the pairs an expert (the fp32 accumulator's
    traffic against the GEMM's): its key holds their mean, rounded up to a power of two, from
    the operand's static size (no read of the offsets), so sizes within a factor of two share
    one search and one shipped entry."""
    seen = []
    pick = grouped.weight_grads.pick_config

    def spy(tuned_, raw, config, kdim, name, key, dtype, k):
        seen.append(dict(key))
        return pick(tuned_, raw, config, kdim, name, key, dtype, k)

    monkeypatch.setattr(grouped.weight_grads, "pick_config", spy)
    n_experts, m, n = 2, 16, 16
    for pairs, want in ((300, 256), (257, 256), (1030, 1024), (1, 1)):
        a = torch.randn(pairs, m)  # contiguous, in pair order
        b = torch.randn(7, n)  # gathered through the index
        idx = torch.randint(0, 7, (pairs,), dtype=torch.int32)
        offs = torch.tensor([0, pairs // 2, pairs], dtype=torch.int32)
        c = torch.zeros(n_experts, m, n)
        grouped.wgrad(a, b, idx, offs, c, a_gather=False, b_gather=True, accumulate=False,
                      config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})  # fmt: skip
        assert seen[-1]["PAIRS"] == want, (pairs, seen[-1])
        ref = torch.stack([a[lo:hi].T @ b[idx[lo:hi].long()] for lo, hi in
                           ((0, pairs // 2), (pairs // 2, pairs))])  # fmt: skip
        torch.testing.assert_close(c, ref, rtol=1e-4, atol=1e-4)
    assert list(seen[-1]) == list(grouped.configs.WGRAD_KEY)
    b = tuned.bucket(seen[0], torch.bfloat16)
    assert b == "M=16,N=16,A_GATHER=0,B_GATHER=1,ACCUMULATE=0,PAIRS=256,bfloat16"
