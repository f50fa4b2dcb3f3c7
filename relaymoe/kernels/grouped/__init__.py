"""Grouped GEMM kernels over the routing index (MoEBlaze §3-5), and their launchers.

Imports only torch, triton, ``relaymoe.kernels`` (limits, the choices, the shipped tuned
configurations) and ``relaymoe.activation`` (the activation the kernels are specialised for).

Shape legend: T tokens, H hidden, I expert FFN width, El local experts, P pairs of the computed
expert range in expert-grouped order (positions ``offs[0]:offs[El]`` of the routing index).

Every kernel takes the full ``expert_token_indices`` (global positions -> token id) and an
``offs`` view of ``El+1`` expert offsets (``index.offsets_for(e0, e1)``). Pair buffers (``h``,
``a``, ``y``...) hold only the range's pairs: row ``q - offs[0]`` for global position ``q``.

Tile schedule: a program's M tile is found on device from ``offs`` (per-expert tile counts, their
prefix sum, and a count of prefix sums not above the program id), so no host sync and no
schedule tensor; the grid is sized from an upper bound (``cdiv(P, BLOCK_M) + El`` M tiles) and
surplus programs exit at once. Consecutive programs share one M tile (the gathered token rows
stay in L2) and walk the N tiles of one expert's weight.

Offsets: token rows, pair rows and expert bases are int64 in the kernels; what stays int32 is an
offset inside one expert's weight (a row or column index times a stride), the pair row ids of the
SwiGLU backward and the launch grid. The launchers check those on sizes before launching
(``ValueError`` naming the value, the 2^31 limit and the fix; ``relaymoe.kernels.check_int32``).

Activations and biases: every kernel that computes the activation specialises on the constexprs
of ``activation.act_meta`` (one ``@triton.jit`` forward and backward for every
``ExpertActivation``); the fc1 bias is added where h is made (the up-projection's epilogue, or the
memory pass after a GEMM that made h), the fc2 bias in the combine, and the bias gradients are
deterministic segment sums (``bias``).

Files: ``tiles`` (the shared tile schedule, grid and checks), ``configs`` (autotune candidates and
the pick of a launch's configuration), ``activation`` (the activation helpers), one file per
kernel and its launcher (``up``, ``rows``, ``swiglu``, ``weight_grads``, ``gather_reduce``,
``bias``). The launchers hold no policy: which kernel a
GEMM takes is ``relaymoe.kernels.select``'s choice, from the ``KernelOptions`` it is given.
"""

from __future__ import annotations

from relaymoe.kernels.grouped import configs
from relaymoe.kernels.grouped import rows as _rows
from relaymoe.kernels.grouped import up as _up
from relaymoe.kernels.grouped import weight_grads as _weight_grads
from relaymoe.kernels.grouped.bias import add_bias_dprobs, segment_sum
from relaymoe.kernels.grouped.gather_reduce import combine
from relaymoe.kernels.grouped.rows import rows_gemm
from relaymoe.kernels.grouped.swiglu import swiglu_backward, swiglu_forward
from relaymoe.kernels.grouped.up import up_swiglu
from relaymoe.kernels.grouped.weight_grads import wgrad

__all__ = [
    "TUNED_KERNELS",
    "add_bias_dprobs",
    "combine",
    "rows_gemm",
    "segment_sum",
    "swiglu_backward",
    "swiglu_forward",
    "up_swiglu",
    "wgrad",
]

# The autotuned kernels by the name the shipped configurations use: (autotuner, its key's
# argument names). The tuner that writes ``tuned_configs.json`` reads their caches; a launcher's
# ``config=`` runs one configuration explicitly (to time each alone).
TUNED_KERNELS = {
    "up_swiglu": (_up.up_tuned, configs.UP_KEY),
    "up_single": (_up.up_single_tuned, configs.UP_KEY),
    "rows_gemm": (_rows.rows_tuned, configs.ROWS_KEY),
    "wgrad": (_weight_grads.wgrad_tuned, configs.WGRAD_KEY),
}
