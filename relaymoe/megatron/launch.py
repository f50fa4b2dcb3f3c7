"""Run your own Megatron-LM training script with ``--moe-token-dispatcher-type ring`` enabled.

    python -m relaymoe.megatron.launch PATH/TO/Megatron-LM/pretrain_gpt.py <megatron args>
    relaymoe-launch PATH/TO/pretrain_gpt.py <megatron args>          # same, console script
    torchrun --nproc-per-node 8 -m relaymoe.megatron.launch pretrain_gpt.py <args>

It calls ``relaymoe.megatron.register()`` (and, with the megatron-core wheel, uses its prebuilt
dataset helpers instead of ``make``) and then runs the script as ``__main__`` (``runpy``),
with ``sys.argv`` as if the script had been started directly and the script's folder first on
``sys.path`` (so ``pretrain_gpt.py`` finds its sibling modules such as ``gpt_builders``).
Nothing of the script is copied or modified.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = (
    "usage: python -m relaymoe.megatron.launch PATH/TO/pretrain_gpt.py [megatron args...]\n"
    "       (registers relaymoe's --moe-token-dispatcher-type ring, then runs the script)"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"relaymoe-launch: no such training script: {script!r}\n{USAGE}", file=sys.stderr)
        return 2
    from relaymoe.megatron import register
    from relaymoe.megatron.pretrain import use_prebuilt_dataset_helpers

    register()
    # Megatron-LM's script runs `make` for the dataset helpers on rank 0; against the pip wheel
    # (no Makefile, helpers prebuilt) that fails and exits. A no-op with a source checkout.
    use_prebuilt_dataset_helpers()
    script = os.path.abspath(script)
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # the script's own exit status
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
