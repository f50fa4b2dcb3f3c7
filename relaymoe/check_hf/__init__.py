"""``relaymoe check-hf``: does a Megatron checkpoint compute what a Hugging Face folder computes?

The step after each conversion: after ``relaymoe convert-hf`` (the folder you started from
against the checkpoint made of it) and after ``relaymoe export-hf`` (the checkpoint against the
folder made of it). It runs a few fixed prompts through Megatron's model, as training builds
it and loaded by Megatron's ``load_checkpoint`` on the host, and through transformers'
``Qwen3MoeForCausalLM``, and prints each prompt's relative logits error and PASS or FAIL
against a stated bound (exit status 0, 1 on FAIL, 2 for a pair it cannot compare).

The modules: ``prompts`` (the fixed prompts), ``megatron_logits`` and ``hf_logits`` (each
side's forward), ``run`` (``check``: the architecture of both, then the comparison), ``cli``
(the subcommand).

An entry point beside the CLI, above ``relaymoe.megatron``: megatron-core and transformers are
imported inside functions, so the subcommand's parser needs neither.
"""

from relaymoe.check_hf.cli import add_parser, main
from relaymoe.check_hf.errors import CheckError
from relaymoe.check_hf.run import TOLERANCE, CheckResult, PromptResult, check

__all__ = ["TOLERANCE", "CheckError", "CheckResult", "PromptResult", "add_parser", "check", "main"]
