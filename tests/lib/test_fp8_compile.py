"""The fp8 kernels compile for sm90 on a CPU machine into fp8 tensor-core instructions.

The interpreter runs the kernels' arithmetic, not their compilation: this compiles the fp8 GEMMs
ahead of time for an sm90 target (front end, layouts, the software pipeline, ptxas) with the
shapes of a real launch (every size a multiple of 16, as Triton specialises them), and checks
that each contraction became ``wgmma`` with the fp8 types it reads (e4m3, or e5m2 gradients:
no fallback to 16-bit), that the contiguous-operand loops are pipelined (shared memory for more
than one stage), and that every kernel fits an H100/H200 SM's shared memory. The "rows" weight
gradient reads both operands across their rows (its contraction runs over pairs), which Triton
stages through registers: not pipelined, and checked as such, so that a Triton that pipelines
it is noticed; the "columnwise" one reads them K-major (transposed copies, pairs contiguous and
16-aligned) and is pipelined.

The compile runs in a child process: the suite runs under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

STAGE_BYTES = 32 * 1024  # one K step of a 128x128 fp8 A tile and a 128x128 fp8 B tile


def _compile(fn, types: dict, consts: dict, warps: int, stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: types.get(n, "constexpr") for n in names}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in types}
    src = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    ptx = kernel.asm["ptx"]
    return {"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.(\w+\.\w+)",
                                            ptx))), "shared": kernel.metadata.shared}  # fmt: skip


def _ints(*names):
    return {n: "i32" for n in names}


def _rows():
    from relaymoe.kernels.fp8 import rows

    types = {"a_ptr": "*fp8e5", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32",
             "idx_ptr": "*i32", "offs_ptr": "*i64", "c_ptr": "*bf16",
             **_ints("n_experts", "N", "K", "stride_ap", "stride_sap", "stride_be", "stride_bn",
                     "stride_sbe", "stride_sbn", "stride_sbk", "stride_cp")}  # fmt: skip
    consts = {"stride_bk": 1, "A_GATHER": True, "BLOCKWISE": True, "PROMOTE": False,
              "EVEN_K": True, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_E": 128,
              "GROUP_M": 8}  # fmt: skip
    return _compile(rows._fp8_rows_kernel, types, consts, 8, 3)


def _up():
    from relaymoe.activation import SWIGLU
    from relaymoe.kernels.fp8 import up
    from relaymoe.kernels.grouped.activation import act_meta

    types = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "aq_ptr": "*fp8e4nv", "idx_ptr": "*i32",
             "offs_ptr": "*i64", "prob_ptr": "*bf16", "h_ptr": "*bf16", "a_ptr": "*bf16",
             **{n: "*fp32" for n in ("sx_ptr", "sw_ptr", "sa_ptr", "amax_ptr")},
             **_ints("n_experts", "H", "I", "stride_xt", "stride_sxt", "stride_we", "stride_wn",
                     "stride_swe", "stride_swn", "stride_hp", "stride_ap", "stride_aqp",
                     "stride_sap")}  # fmt: skip
    consts = {"BLOCKWISE": False, "SAVE_H": True, "STORE_A": True, "AMAX_A": True,
              "QUANT_A": False, "SCALE": True, "EVEN_K": True, "FMT": "e4m3", "POW2": True,
              "EXACT": False, "A_DTYPE": "bf16", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128,
              "BLOCK_E": 128, "GROUP_M": 8, **act_meta(SWIGLU)}  # fmt: skip
    return _compile(up._fp8_up_kernel, types, consts, 8, 3)


def _wgrad():
    from relaymoe.kernels.fp8 import wgrad

    types = {"a_ptr": "*fp8e5", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
             "idx_ptr": "*i32", "offs_ptr": "*i64", "c_ptr": "*bf16",
             **_ints("M", "N", "stride_a", "stride_b", "stride_ce", "stride_cm",
                     "stride_cn")}  # fmt: skip
    consts = {"A_GATHER": True, "B_GATHER": False, "ACCUMULATE": False, "BLOCK_M": 128,
              "BLOCK_N": 128, "BLOCK_K": 128}  # fmt: skip
    return _compile(wgrad._fp8_wgrad_kernel, types, consts, 8, 3)


def _wgrad_columnwise():
    from relaymoe.kernels.fp8 import wgrad

    types = {"a_ptr": "*fp8e5", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
             "poffs_ptr": "*i64", "c_ptr": "*bf16",
             **_ints("M", "N", "stride_a", "stride_b", "stride_ce", "stride_cm",
                     "stride_cn")}  # fmt: skip
    consts = {"ACCUMULATE": True, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}
    return _compile(wgrad._fp8_wgrad_cols_kernel, types, consts, 8, 4)


def _child() -> None:
    print(json.dumps({"rows": _rows(), "up": _up(), "wgrad": _wgrad(),
                      "wgrad_columnwise": _wgrad_columnwise()}))  # fmt: skip


def test_fp8_kernels_compile_to_fp8_wgmma_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=600, cwd=root)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rows"]["wgmma"] == ["e5m2.e4m3"], got  # dy (e5m2) gathered x w2 (e4m3)
    assert got["up"]["wgmma"] == ["e4m3.e4m3"], got
    assert got["wgrad"]["wgmma"] == ["e5m2.e4m3"], got
    assert got["rows"]["shared"] >= 2 * STAGE_BYTES and got["up"]["shared"] >= 3 * STAGE_BYTES
    assert got["wgrad"]["shared"] <= STAGE_BYTES  # staged through registers, one stage
    # K-major operands (pairs contiguous, 16-aligned): loaded by cp.async in 4 stages
    assert got["wgrad_columnwise"]["wgmma"] == ["e5m2.e4m3"], got
    assert got["wgrad_columnwise"]["shared"] >= 3 * STAGE_BYTES, got
    assert all(k["shared"] <= 227 * 1024 for k in got.values()), got  # fits one SM


if __name__ == "__main__":
    _child()
