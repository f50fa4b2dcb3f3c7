"""``relaymoe plan``: what fits per GPU, alltoall vs ring, each with Megatron's loss or the fused
one, and the Megatron flags to paste; ``relaymoe flags``; ``relaymoe data`` (tokenise a corpus
into Megatron's indexed dataset); ``relaymoe convert-hf`` / ``export-hf`` (a Hugging Face
Qwen3-MoE checkpoint to a Megatron ``torch_dist`` one and back) and ``relaymoe check-hf`` (both
give the same logits?), each in its own package beside this module."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from relaymoe.config import DISPATCHERS
from relaymoe.options import MODE_CHOICES, TRANSPORT_CHOICES
from relaymoe.planner.memory import TE_IMPL, TRANSFORMER_IMPLS

DEFAULT_CONFIG = "qwen3_30b_a3b"
# the Hugging Face subcommands -> their package (each has add_parser and main)
HF_TOOLS = {"convert-hf": "convert_hf", "export-hf": "export_hf", "check-hf": "check_hf"}
_PAR = {"tp": "tp", "cp": "cp", "pp": "pp", "vpp": "vpp", "ep": "ep", "etp": "etp", "dp": "dp"}
# The other whole-number overrides of ``plan`` and ``flags``: (flag, help), in --help order.
_INT_OVERRIDES = (
    (
        "gpus-per-node",
        "GPUs per node of the cluster (override parallel.gpus_per_node; default: the EP group "
        "in one node): picks the ring's schedule, flat or two-level across nodes",
    ),
    ("mbs", "override training.micro_batch_size"),
    (
        "gbs",
        "override training.global_batch_size (default: the config's, kept when --dp or --mbs "
        "change; micro_batch_size * dp when the config sets none)",
    ),
    ("seq", "override training.seq_length"),
)


def _parser() -> argparse.ArgumentParser:
    from relaymoe import __version__

    p = argparse.ArgumentParser(prog="relaymoe", description="relaymoe tools")
    p.add_argument("--version", action="version", version=f"relaymoe {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser(
        "plan",
        help="memory plan of a config: alltoall vs ring, Megatron's loss vs the fused loss, "
        "recompute plan, capacity limits",
        description="Plans a Megatron GPT-MoE config on a given GPU (default: the embedded "
        "Qwen3-30B-A3B on 32 H100-80GB, TP=2 CP=4 PP=4 EP=8).",
    )
    q.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="YAML path or a name in configs/ (default %(default)s)",
    )
    q.add_argument(
        "--gpu",
        default="h100-80gb",
        help="h100-80gb | h100-64gb (the paper's) | h200-141gb | a100-80gb | a100-40gb | bytes "
        "(e.g. 85899345920 or 80GiB); default %(default)s",
    )
    _add_overrides(q, dispatchers=("ring", "alltoall"))
    q.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default=TE_IMPL,
        help="Megatron's --transformer-impl the per-policy longest sequences are predicted for "
        "(default %(default)s)",
    )
    q.add_argument("--json", action="store_true", help="print one JSON object")
    f = sub.add_parser(
        "flags",
        help="the Megatron flags of a config, one flag with its values per line (what "
        "examples/qwen3/train.sh passes)",
        description="Prints a config's model, parallelism, batch and relaymoe flags for "
        "Megatron, one flag with its values per line, after the launch's own checks on them; "
        "with --world, first checks that the config's layout fills exactly that many GPUs.",
    )
    f.add_argument("--config", default=DEFAULT_CONFIG, help="YAML path or a name in configs/")
    _add_overrides(f, dispatchers=DISPATCHERS)
    f.add_argument(
        "--world",
        type=int,
        default=None,
        help="the GPUs the job will have (NNODES x GPUS_PER_NODE); refused when the config's "
        "tp x cp x pp x dp differs",
    )
    _add_tool_parsers(sub)
    return p


def _add_overrides(q: argparse.ArgumentParser, dispatchers: tuple[str, ...]) -> None:
    """The config overrides ``plan`` and ``flags`` share (one builder, :func:`build_config`,
    so that both print the same Megatron flags for the same config and overrides)."""
    for k in _PAR:
        q.add_argument(f"--{k}", type=int, default=None, help=f"override parallel.{k}")
    for flag, help_ in _INT_OVERRIDES:
        q.add_argument(f"--{flag}", type=int, default=None, help=help_)
    q.add_argument(
        "--dispatcher", choices=dispatchers, default=None, help="override relaymoe.dispatcher"
    )
    q.add_argument(
        "--mode",
        choices=MODE_CHOICES,
        default=None,
        help="force relaymoe's mode (default: the config's; auto: the cost model's choice)",
    )
    q.add_argument(
        "--transport",
        choices=TRANSPORT_CHOICES,
        default=None,
        help="override relaymoe.transport (auto: the copy engine, whose workspace is counted)",
    )
    q.add_argument(
        "--hop-slice-mib",
        type=int,
        default=None,
        help="override relaymoe.hop_slice_mib: the MiB budget of one ring hop's expert "
        "intermediates (--relaymoe-hop-slice-mib; 0: never sliced)",
    )
    q.add_argument(
        "--fused-loss",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override relaymoe.fused_loss: the flags and recompute plan are for the chunked "
        "output layer + cross-entropy (the capacities are printed for both anyway)",
    )
    q.add_argument(
        "--gradient-accumulation-fusion",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override training.gradient_accumulation_fusion (Megatron's default: on; off is "
        "--no-gradient-accumulation-fusion in the flags): with it the ring's experts add their "
        "weight gradients into main_grad, and the plan counts no buffer for them",
    )


def _add_tool_parsers(sub) -> None:
    """Subcommands that live beside the code they run (their modules import nothing heavy at
    import time; megatron-core is imported when the command runs)."""
    from relaymoe import check_hf, convert_hf, data, export_hf

    data.add_parser(sub)
    for tool in (convert_hf, export_hf, check_hf):  # Hugging Face in, out, and the check
        tool.add_parser(sub)


def build_config(ns):
    """``(cfg, notes)``: the config with the command line's overrides, and one line for each
    value an override changed besides the one it names, or that the flags render differently
    from the config (``relaymoe.config.megatron_notes``)."""
    from relaymoe.config import load_config, megatron_notes

    cfg = load_config(ns.config)
    notes: list[str] = []
    par = {k: getattr(ns, k) for k in _PAR if getattr(ns, k) is not None}
    if ns.gpus_per_node is not None:
        par["gpus_per_node"] = ns.gpus_per_node
    tr = {}
    if ns.mbs is not None:
        tr["micro_batch_size"] = ns.mbs
    if ns.seq is not None:
        tr["seq_length"] = ns.seq
    if ns.gradient_accumulation_fusion is not None:
        tr["gradient_accumulation_fusion"] = ns.gradient_accumulation_fusion
    if ns.gbs is not None:
        tr["global_batch_size"] = ns.gbs
    elif ns.mbs is not None or "dp" in par:
        tr["global_batch_size"] = _kept_global_batch(cfg, ns.mbs, par.get("dp"), notes)
    rel = {}
    if ns.dispatcher:
        rel["dispatcher"] = ns.dispatcher
    if ns.mode:
        rel["mode"] = ns.mode
    if ns.transport:
        rel["transport"] = ns.transport
    if ns.hop_slice_mib is not None:
        rel["hop_slice_mib"] = ns.hop_slice_mib
    if ns.fused_loss is not None:
        rel["fused_loss"] = ns.fused_loss
    cfg = cfg.replace(parallel=par, training=tr, relaymoe=rel)
    return cfg, notes + megatron_notes(cfg)


def _kept_global_batch(cfg, mbs: int | None, dp: int | None, notes: list[str]) -> int | None:
    """The global batch size under new ``--mbs``/``--dp`` without ``--gbs``.

    Megatron's global batch size is the optimiser's batch, not a product of the layout: a
    different data-parallel size or micro-batch changes how many micro-batches each rank
    accumulates per step, not the batch. So the config's value is kept (a note gives the new
    accumulation), and refused when it is no multiple of ``micro_batch_size * dp``; a config
    without one gets Megatron's default ``micro_batch_size * dp``, with a note when that moved."""
    t, p = cfg.training, cfg.parallel
    new_mbs, new_dp = mbs or t.micro_batch_size, dp or p.dp
    per_step = new_mbs * new_dp
    what = " ".join(f for f, v in (("--mbs", mbs), ("--dp", dp)) if v is not None)
    if t.global_batch_size is None:
        old = t.micro_batch_size * p.dp
        if per_step != old:
            notes.append(
                f"{what}: the global batch size is micro_batch_size*dp = {per_step} (was {old}; "
                "the config sets none): pass --gbs to keep another"
            )
        return None
    gbs = t.global_batch_size
    if gbs % per_step:
        raise ValueError(
            f"{what}: training.global_batch_size={gbs} is not a multiple of micro_batch_size*dp "
            f"= {new_mbs}*{new_dp} = {per_step}; pass --gbs with a multiple of {per_step}"
        )
    old_acc, new_acc = gbs // (t.micro_batch_size * p.dp), gbs // per_step
    if old_acc != new_acc:
        notes.append(
            f"{what}: the global batch size stays {gbs} (training.global_batch_size); each "
            f"data-parallel rank now accumulates {new_acc} micro-batches a step (was {old_acc})"
        )
    return gbs


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _mib(x) -> str:
    return f"{x / 2**20:.1f}"


# Variants as printed: the three the question is about first, then the fused loss alone.
ORDER = ("alltoall", "ring", "ring_fused_loss", "alltoall_fused_loss")
LABEL = {
    "alltoall": "alltoall",
    "ring": "ring",
    "ring_fused_loss": "ring + fused loss",
    "alltoall_fused_loss": "alltoall + fused loss",
}


def _binding(p, v) -> str:
    """The term that binds the variant's longest sequence (``recompute.binding_term``: the
    largest term that grows with the sequence) on the worst stage there."""
    from relaymoe.planner.recompute import binding_term

    at = p.max_seq_breakdown.get(v)
    term = binding_term(at["terms"]) if at else None
    if term is None:
        return "-"
    return f"{term} {_gib(at['terms'][term])} GiB on stage {at['stage']}"


def policy_lines(p) -> list[str]:
    """Each variant's longest sequence under each recompute policy (``Plan.policies``) and the
    term that binds it; then, where the config's dispatcher is alltoall, megatron-core's own
    memory flags as the alternative to the ring."""
    from relaymoe.planner.policies import POLICIES

    impl = "TransformerEngine" if p.transformer_impl == TE_IMPL else "local layers"
    lines = [
        f"Longest sequence per recompute policy ({impl}; full: every layer, selective: "
        "megatron-core's memory set for alltoall, the recompute plan for the ring; binds):"
    ]
    w = max(len(LABEL[v]) for v in ORDER)
    for v in ORDER:
        cells = []
        for policy in POLICIES:
            r = p.policies[v][policy]
            cells.append(f"{policy} {r['max_seq']:>8} ({r['binding_term'] or '-'})")
        lines.append(f"  {LABEL[v]:<{w}}  " + "  ".join(cells))
    if p.mcore_memory_flags:
        lines.append(
            "megatron-core's own memory flags (the alternative with the alltoall dispatcher; "
            "the selective row above): " + " ".join(p.mcore_memory_flags)
        )
    return lines


RECOMPUTE_COLUMNS = (
    ("variant", "left"),
    ("recompute", "left"),
    ("kept", "right"),
    ("recomputed", "right"),
    ("budget GiB", "right"),
)


def recompute_summary(r: dict) -> str:
    """One cell for a recompute plan (``RecomputePlan.to_dict()``): the Megatron setting."""
    if r["recompute_granularity"] is None:
        return "none: all kept"
    text = str(r["recompute_granularity"])
    if r["recompute_method"] is not None:
        text += f" {r['recompute_method']} {r['recompute_num_layers']}/stage"
    if r.get("recompute_modules"):
        text += f" ({', '.join(r['recompute_modules'])})"
    return text


def _print_rich(cfg, p) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    m, par, t = cfg.model, cfg.parallel, cfg.training
    con.print(
        f"[bold]{cfg.name}[/]: {m.num_layers} layers, E={m.num_experts} K={m.moe_router_topk} "
        f"H={m.hidden_size} I={m.moe_ffn_hidden_size} V={m.vocab_size}; {par.world_size} GPUs "
        f"(TP={par.tp} CP={par.cp} PP={par.pp} EP={par.ep} ETP={par.etp} DP={par.dp}); "
        f"seq {t.seq_length}, micro-batch {t.micro_batch_size}; GPU {_gib(p.gpu_bytes)} GiB "
        f"(the driver's total), usable {_gib(p.usable_bytes)} GiB (less the CUDA context "
        "and reserves)"
    )
    tab = Table(title="Peak memory per GPU, worst pipeline stage (GiB)")
    tab.add_column("term", no_wrap=True)
    for v in ORDER:
        tab.add_column(LABEL[v], justify="right")
    for k in p.breakdown["ring"]:
        tab.add_row(k, *(_gib(p.breakdown[v].get(k)) for v in ORDER))
    tab.add_row("[bold]peak (planned recompute)", *(_gib(p.peak_bytes[v]) for v in ORDER))
    tab.add_row("peak (full recompute)", *(_gib(p.peak_full_recompute_bytes[v]) for v in ORDER))
    moe = {v: p.moe_peak_bytes[v.removesuffix("_fused_loss")] for v in ORDER}
    tab.add_row("MoE block peak", *(_gib(moe[v]) for v in ORDER))
    con.print(tab)
    a2a = p.max_seq_length["alltoall"]
    con.print(
        f"[bold]What fits[/], full recompute (max seq length at micro-batch "
        f"{t.micro_batch_size}, max micro-batch at seq {t.seq_length}; binds: the worst "
        "stage's largest term that grows with the sequence, at that length):"
    )
    w = max(len(LABEL[v]) for v in ORDER)
    for v in ORDER:  # plain lines: greppable, and not squeezed by a narrow terminal
        n = p.max_seq_length[v]
        gain = f"{n / a2a:.2f}x" if a2a else "-"
        con.print(
            f"  {LABEL[v]:<{w}}  max seq length {n:>8} ({gain} alltoall)  "
            f"max micro-batch {p.max_micro_batch_size[v]:>4}  binds: {_binding(p, v)}",
            soft_wrap=True,
            highlight=False,
        )
    for line in policy_lines(p):
        con.print(line, soft_wrap=True, highlight=False)
    hop, sm = p.per_hop_bytes, p.step_model
    model = ", ".join(
        f"{m} {sm[m]['seconds'] * 1e3:.2f} ms / "
        f"{_mib(sm[m]['bytes_forward'] + sm[m]['bytes_backward'])} MiB"
        for m in sm
    )
    # the alltoall mode runs on the EP group's collectives whatever the ring's transport
    over = "NCCL collectives" if p.routing_mode == "alltoall" else p.transport
    con.print(
        f"relaymoe mode: [bold]{p.routing_mode}[/] over {over} (modelled layer step, "
        f"time / bytes sent: {model}; per hop, fwd+bwd: expert {_mib(hop['expert']['total'])} "
        f"MiB, token {_mib(hop['token']['total'])} MiB)"
    )
    for line in schedule_lines(p, par.ep):
        con.print(line, soft_wrap=True, highlight=False)
    # narrow enough for an 80-column terminal with no header cut (tests/test_cli.py)
    rt = Table(
        title="Recompute plan (greedy by compute saved per byte, paper §3.4)", pad_edge=False
    )
    for name, justify in RECOMPUTE_COLUMNS:
        rt.add_column(name, justify=justify, no_wrap=True)
    for v in ORDER:
        r = p.recompute_plans.get(v)
        if r is None:
            rt.add_row(LABEL[v], "does not fit", "-", "-", "-")
            continue
        rt.add_row(
            LABEL[v],
            recompute_summary(r),
            str(len(r["kept_layers"])),
            str(len(r["recomputed_layers"])),
            _gib(r["budget_bytes"]),
        )
    con.print(rt)
    for n in p.notes:
        con.print(f"[yellow]note[/]: {n}")
    con.print(f"[bold]Megatron flags ({LABEL[p.chosen]}):[/]")
    con.print(" ".join(p.megatron_flags), soft_wrap=True, highlight=False)


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def schedule_lines(p, ep: int) -> list[str]:
    """The ring's schedule for the cluster shape and, per schedule, its modelled hop times
    (``Plan.hop_times``): hops per layer step inside a node and across nodes, the slowest hop
    of each kind (compute + exposed transfer), the layer step with the host time, and the layer
    step's peak memory over its inputs."""
    G = p.gpus_per_node
    t = p.hop_times[p.schedule]
    if t["nodes"] > 1:
        where = f"EP={ep} over {t['nodes']} nodes of {t['gpus_per_node']} EP ranks"
    elif G is None:
        where = f"EP={ep} in one node (--gpus-per-node N plans a cluster of N-GPU nodes)"
    else:
        where = f"EP={ep} in one node of {G} GPUs"
    lines = [
        f"ring schedule: {p.schedule} ({where})",
        f"  {t['mode']}-mode hops of a layer step (hop: compute {_ms(t['hop_compute_s'])} ms + "
        f"exposed transfer; host {_ms(t['host_s'])} ms a step):",
    ]
    for name, h in p.hop_times.items():
        mark = "*" if name == p.schedule else " "
        lines.append(
            f" {mark}{name:<12} inside nodes {_hops(h, 'intra')}  across {_hops(h, 'inter')}  "
            f"step {_ms(h['step_s'])} ms  peak {h['layer_peak_bytes'] / 2**30:.2f} GiB"
        )
    return lines


def _hops(h: dict, kind: str) -> str:
    """``count x slowest hop`` of one kind of hop."""
    n = h[f"{kind}_hops"]
    return f"{n:>3} x {_ms(h[f'{kind}_hop_s']):>6} ms" if n else f"{n:>3} x {'-':>6}   "


def check_world(cfg, world: int) -> None:
    """ValueError unless the config's layout fills exactly ``world`` GPUs."""
    p = cfg.parallel
    if world < 1:
        raise ValueError(f"--world {world}: the job needs at least one GPU")
    if p.world_size != world:
        raise ValueError(
            f"config {cfg.name} needs tp*cp*pp*dp = {p.tp}*{p.cp}*{p.pp}*{p.dp} = "
            f"{p.world_size} GPUs, but the job has {world}; fix: launch on {p.world_size} GPUs "
            f"(NNODES x GPUS_PER_NODE), or use a config whose layout fills {world}"
        )


def check_launch(flags: list[str]) -> None:
    """The plugin's own launch-time refusals (``relaymoe.megatron.validate``: the ring
    dispatcher's and the fused loss's, the functions ``register()``'s patches run on Megatron's
    parsed arguments) applied to ``flags``, as one line: a layout the launch would refuse is
    refused here, with every reason and its fix."""
    from relaymoe.config import megatron_namespace
    from relaymoe.megatron.validate import launch_refusal

    why = launch_refusal(megatron_namespace(flags))
    if why is not None:
        raise ValueError(why)


def _flags(ns) -> int:
    from relaymoe.config import flag_groups, to_megatron_args

    try:
        cfg, notes = build_config(ns)
        if ns.world is not None:
            check_world(cfg, ns.world)
        args = to_megatron_args(cfg)
        check_launch(args)
    except ValueError as e:
        print(f"relaymoe flags: error: {e}", file=sys.stderr)
        return 2
    for n in notes:  # stderr: stdout stays one flag per line for the launch scripts
        print(f"relaymoe flags: note: {n}", file=sys.stderr)
    for words in flag_groups(args):
        print(shlex.join(words))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``relaymoe`` command: one line and exit status 2 for a refused argument or file, no
    traceback; 130 on Ctrl-C; quiet when its output's reader goes away (``relaymoe flags |
    head``). The host warnings that ask nothing of the user are silenced first
    (``relaymoe.host_warnings``)."""
    from relaymoe.host_warnings import quiet_host_warnings

    quiet_host_warnings()
    ns = _parser().parse_args(argv)
    try:
        rc = _run(ns)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return rc
    except BrokenPipeError:
        # the reader stopped reading (head): nothing more to say, and nowhere to say it
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell tool killed by it
    except KeyboardInterrupt:
        print(f"relaymoe {ns.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a file or folder the command cannot read or write
        print(f"relaymoe {ns.command}: error: {_os_error(e)}", file=sys.stderr)
        return 2


def _os_error(e: OSError) -> str:
    """An ``OSError`` as one line: what failed, on which path."""
    what = e.strerror or str(e)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{what}: {' -> '.join(paths)}" if paths else what


def _run(ns) -> int:
    if ns.command == "flags":
        return _flags(ns)
    if ns.command == "data":
        from relaymoe import data

        return data.main(ns)
    if ns.command in HF_TOOLS:
        import importlib

        return importlib.import_module(f"relaymoe.{HF_TOOLS[ns.command]}").main(ns)
    from relaymoe.config import to_megatron_args
    from relaymoe.planner import plan

    try:
        cfg, notes = build_config(ns)
        check_launch(to_megatron_args(cfg))
        p = plan(cfg, ns.gpu, notes=notes, transformer_impl=ns.transformer_impl)
    except ValueError as e:
        print(f"relaymoe plan: error: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(p.to_dict(), indent=1))
    else:
        _print_rich(cfg, p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
