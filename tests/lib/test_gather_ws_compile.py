"""The Gluon kernels of ``relaymoe.kernels.gather_ws`` compile for sm90 on a CPU machine.

Gluon is experimental and its API moves between Triton releases (``thread_barrier`` became
``barrier`` after 3.6). The GPU machine runs one Triton, this suite another; compiling ahead of
time for an sm90 target (front end, layouts, warp specialisation, ptxas) catches a break here
instead of at a user's first launch. Skipped where Gluon does not import.

The compile runs in a child process: the suite runs under ``TRITON_INTERPRET=1``, which turns
every jit function into an interpreted one that cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

E, I, H = 8, 768, 2048


def _compile(w_kn: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from relaymoe.kernels import gather_ws

    cfg = gather_ws.ROWS_CONFIG if w_kn else gather_ws.UP_CONFIG
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    rows = torch.empty(E * H, I, dtype=torch.bfloat16) if w_kn else torch.empty(E * 2 * I, H)
    x_layout, w_block, w_layout, epi_layout = gather_ws._layouts(bm, bn, bk, torch.bfloat16, w_kn)
    desc = gather_ws.TensorDescriptor.from_tensor(rows.to(torch.bfloat16), w_block, w_layout)
    fn = gather_ws._gathered_gemm_ws_kernel
    types = {"x_ptr": "*bf16", "w_desc": mangle_type(desc), "idx_ptr": "*i32", "offs_ptr": "*i64",
             "prob_ptr": "*bf16", "h_ptr": "*bf16", "a_ptr": "*bf16"}  # fmt: skip
    for name in ("n_experts", "K", "n_cols", "n_tiles", "stride_xt", "stride_hp", "stride_ap"):
        types[name] = "i32"
    consts = {
        "x_layout": x_layout, "epi_layout": epi_layout, "W_KN": w_kn, "SAVE_H": True,
        "SCALE": not w_kn, "SAVE_A": not w_kn, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
        "BLOCK_E": 32, "STAGES": cfg["STAGES"], "EPI_ROWS": cfg["EPI_ROWS"],
        "GROUP_M": cfg["GROUP_M"],
        "PRODUCER_WARPS": cfg["producer_warps"], "PRODUCER_REGS": cfg["producer_regs"],
        "STORER_WARPS": cfg["storer_warps"], "STORER_REGS": cfg["storer_regs"],
        "num_warps": cfg["num_warps"],
    }  # fmt: skip
    names = fn.arg_names
    signature = {n: types.get(n, "constexpr") for n in names}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    aligned = [n for n in types if n != "w_desc"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _child(kind: str) -> None:
    kernel = _compile(kind == "rows_gemm")
    ptx = kernel.asm["ptx"]
    print(json.dumps({
        "noinc_arrive": "cp.async.mbarrier.arrive.noinc" in ptx,  # the producer's stage signal
        "wgmma": "wgmma.mma_async" in ptx,
        "setmaxnreg": "setmaxnreg" in ptx,  # the partitions' register split
        "shared": kernel.metadata.shared,
    }))  # fmt: skip


@pytest.mark.parametrize("kind", ["up_swiglu", "rows_gemm"])
def test_compiles_for_sm90(kind):
    pytest.importorskip("triton.experimental.gluon")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, __file__, kind], env=env, capture_output=True, text=True,
                       timeout=600, cwd=root)  # fmt: skip
    if "No module named" in r.stderr and "gather_ws" not in r.stderr:
        pytest.skip(f"Gluon does not import here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["noinc_arrive"] and got["wgmma"] and got["setmaxnreg"], got
    assert got["shared"] <= 227 * 1024  # fits one H100/H200 SM


if __name__ == "__main__":
    _child(sys.argv[1])
