"""bench="fault": a dead or stalled expert-parallel peer is named, fast (issue #17 item 1).

Each case builds a fresh process group, runs two healthy ``ring_moe`` steps (forward and
backward), then a third in which one rank, the *victim*, fails:

* ``before``: the victim exits (``os._exit``) before the call; the survivors call after it died
  (their agreement's all-reduce meets the dead rank);
* ``before_cached``: the same with ``trusted=True`` (Megatron's path): the agreement is cached, so
  the first thing that meets the dead rank is a ring hop;
* ``mid_fwd`` / ``mid_bwd``: the victim exits inside the forward / backward, at ring hop 1 (the
  all-to-all mode: at its second exchange of the pass);
* ``stall``: the victim stops answering at forward hop 1 (it sleeps past the timeout + 20 s).

With ``RELAYMOE_RING_HOST_WAIT=lag`` (``--host-wait lag``) a survivor makes one more ring call
after the armed one before it synchronises, as the next layer of a model would: a pass's end
waits for the pass before it.

Every survivor must raise ``RingPeerError`` naming the call, the EP group, the timeout and, where
it knows, the victim (never a wrong diagnosis, never returned data), within the process group's
timeout + 15 s of the fault (of its own call for ``before*``).

Row (one per case): ``bench="fault"``, ``case``, ``transport``, ``mode``, ``backend``, ``ep``,
``timeout_s``, ``detected_s`` (the slowest survivor's seconds to its error), ``ok``, ``victim``,
``message`` (a survivor's error), ``why`` (what failed, when not ok).

    python benchmarks/fault.py --backend gloo [--timeout 5] [--world 2,3] [--out PATH.jsonl]
    python benchmarks/fault.py --backend nccl [--world 2]      # GPU: one torchrun per case
    torchrun --nproc-per-node 2 benchmarks/fault.py --backend nccl --one \\
        --case mid_fwd --mode expert --transport copy_engine --outdir DIR   # one case

On gloo the ranks are forked from one clean launcher process (no re-import per case); on NCCL
each case is its own ``torchrun`` job (a victim exits with code 0, so torchrun does not tear down
the survivors; NCCL's watchdog keeps its defaults: a row whose survivor it killed says so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from relaymoe import options  # noqa: E402
from relaymoe.options import env_var  # noqa: E402
from relaymoe.ring.faults import HOST_WAITS, nccl_margin_s  # noqa: E402

HOST_WAIT_ENV = env_var("host_wait")

CASES = ("before", "before_cached", "mid_fwd", "mid_bwd", "stall")
MODES = ("expert", "token", "alltoall")
SLACK_S = 15.0  # the issue's target: detected within the timeout + 15 s
_BEFORE_WAIT_S = 0.5
# a torchrun case's start, NCCL set-up and two healthy steps (kernels compiled, one configuration
# each: the cases run with RELAYMOE_AUTOTUNE=0, they check errors, not speed)
CASE_OVERHEAD_S = 90.0  # survivors call this long after the victim's exit


def _host_wait() -> str:
    """The CUDA host wait this process runs with: the environment's, else the ring's default."""
    return os.environ.get(HOST_WAIT_ENV, HOST_WAITS[0])


@dataclass(frozen=True)
class Spec:
    """One case: ``world`` ranks, the EP group ``ep`` (global ranks; all when empty), the
    ``victim`` (a global rank of the group). ``timeout_s`` is the ring's timeout: the process
    group's, or, when ``pg_timeout_s`` is set, ``RELAYMOE_RING_TIMEOUT_S`` under a group whose
    own timeout is ``pg_timeout_s`` (then only the ring's own bounded waits end a stall)."""

    case: str
    mode: str
    transport: str = "nccl"
    world: int = 2
    timeout_s: float = 5.0
    pg_timeout_s: float | None = None
    env: tuple[tuple[str, str], ...] = ()  # environment of every rank (e.g. the pair budget)
    victim: int = 1
    ep: tuple[int, ...] = ()
    backend: str = "gloo"
    tokens: int = 6
    hidden: int = 16
    ffn: int = 8
    experts_per_rank: int = 2
    topk: int = 2
    schedule: str = "auto"  # RingConfig.schedule; "node_batched" also arms its row exchanges
    gpus_per_node: int | None = None
    # RingConfig.capture_hops on every rank: the hops replay recorded bodies (trusted calls only,
    # so every case of a capturing spec calls trusted, as Megatron does)
    capture_hops: bool = False

    @property
    def group_ranks(self) -> tuple[int, ...]:
        return self.ep or tuple(range(self.world))

    def label(self) -> str:
        pg = f"-pg{self.pg_timeout_s:g}" if self.pg_timeout_s else ""
        hw = dict(self.env).get(HOST_WAIT_ENV)
        wait = f"-wait{hw}" if hw else ""
        sched = "" if self.schedule == "auto" else f"-{self.schedule}-g{self.gpus_per_node}"
        cap = "-captured" if self.capture_hops else ""
        return (
            f"{self.case}-{self.mode}-{self.transport}-w{self.world}-ep{len(self.group_ranks)}"
            f"{pg}{wait}{sched}{cap}"
        )


# ---------------------------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------------------------
def _arm_victim(spec: Spec, store, state: dict) -> None:
    """Hooks that make this process fail at the case's point of the armed (third) call."""
    from relaymoe.ring import token_mode
    from relaymoe.ring.executor import CopyEngineTransport, P2PTransport

    def fail():
        store.set("fault/at", repr(time.time()))
        if spec.case == "stall":
            time.sleep(spec.timeout_s + 20.0)  # alive and silent past every survivor's timeout
        os._exit(0)  # code 0: torchrun must not tear the survivors down

    target_pass = 2 if spec.case == "mid_bwd" else 1
    cls = CopyEngineTransport if spec.transport == "copy_engine" else P2PTransport
    real_issue = cls.issue

    def issue(self, xfer, send, recv):
        if state["armed"]:
            if xfer.hop == 0:
                state["passes"] += 1
            if xfer.hop == 1 and state["passes"] == target_pass:
                fail()
        return real_issue(self, xfer, send, recv)

    cls.issue = issue
    real_exchange = token_mode._exchange
    # the forward exchanges counts, x rows, metadata, outputs; the backward x, dy, dx, dprobs
    target_call = 5 if spec.case == "mid_bwd" else 2

    def exchange(*args, **kwargs):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == target_call:
                fail()
        return real_exchange(*args, **kwargs)

    token_mode._exchange = exchange
    if spec.schedule == "node_batched":  # the row's all-gather (forward) / reduce-scatter (bwd)
        from relaymoe.ring import expert_mode

        real_row = expert_mode.row_exchange
        phase = "bwd" if spec.case == "mid_bwd" else "fwd"

        def row_exchange(*args, **kwargs):
            if state["armed"] and kwargs.get("phase") == phase:
                fail()
            return real_row(*args, **kwargs)

        expert_mode.row_exchange = row_exchange


def _inputs(spec: Spec, group_rank: int, device, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + group_rank)
    El, H, I, K, T = spec.experts_per_rank, spec.hidden, spec.ffn, spec.topk, spec.tokens
    E = El * len(spec.group_ranks)
    dt = torch.float32
    x = torch.randn(T, H, generator=g, dtype=dt).to(device).requires_grad_()
    w13 = (torch.randn(El, 2 * I, H, generator=g, dtype=dt) / H**0.5).to(device).requires_grad_()
    w2 = (torch.randn(El, H, I, generator=g, dtype=dt) / I**0.5).to(device).requires_grad_()
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].to(device)
    probs = torch.rand(T, K, generator=g, dtype=dt).to(device).requires_grad_()
    return x, w13, w2, idx, probs


def _step(spec: Spec, group, group_rank: int, device, step: int, trusted: bool, ring: dict):
    """One ring_moe forward and backward on this rank's inputs."""
    import torch

    from relaymoe.ring import ring_moe

    x, w13, w2, idx, probs = _inputs(spec, group_rank, device, step)
    out = ring_moe(x, w13, w2, idx, probs, group=group, trusted=trusted, **ring)
    out.backward(torch.ones_like(out))
    return out


def _expectations(err, spec: Spec, me: int) -> list[str]:
    """What a survivor's RingPeerError must say; the list of what it does not."""
    bad = []
    group = spec.group_ranks
    others = set(group) - {me}
    if tuple(err.group_ranks) != group:
        bad.append(f"group_ranks {err.group_ranks} != {group}")
    # NCCL: the ring gives up a margin before the group's timeout (faults.ring_timeout_s)
    low = spec.timeout_s - (nccl_margin_s(spec.timeout_s) if spec.backend == "nccl" else 0.0)
    if not low - 1e-6 <= err.timeout_s <= spec.timeout_s + 1e-6:
        bad.append(f"timeout_s {err.timeout_s} outside [{low}, {spec.timeout_s}]")
    if err.rank != me:
        bad.append(f"rank {err.rank} != {me}")
    if err.peers is not None and (not err.peers or not set(err.peers) <= others):
        bad.append(f"peers {err.peers} not among the other ranks {sorted(others)}")
    if len(group) == 2 and err.peers is not None and set(err.peers) != {spec.victim}:
        bad.append(f"peers {err.peers} != the victim {spec.victim}")
    msg = str(err)
    # the message names the timeout the ring waited (on NCCL the group's less the margin)
    for needle in (str(list(group)), f"{err.timeout_s:g} s", err.call, "restart"):
        if needle not in msg:
            bad.append(f"message lacks {needle!r}")
    if err.mode not in (spec.mode, "ring") or not err.call:
        bad.append(f"call {err.call!r} does not name the mode {spec.mode!r}")
    return bad


def rank_main(spec: Spec, rank: int, group, store, device, outdir: str) -> None:
    """Run the case on this rank (process group initialised) and write ``rank{r}.json``."""
    from relaymoe.ring import RingRuntime
    from relaymoe.ring.faults import RingPeerError

    res: dict = {"rank": rank, "victim": rank == spec.victim}
    # this rank's entry point: its case's environment with the spec's ring options, and one
    # runtime for its steps (a trusted call's cached agreement, as a dispatcher's)
    config = options.from_env().replace(
        mode=spec.mode, transport=spec.transport, schedule=spec.schedule,
        gpus_per_node=spec.gpus_per_node, capture_hops=spec.capture_hops,
    )  # fmt: skip
    ring = {"config": config, "runtime": RingRuntime(group)}
    out_path = Path(outdir, f"rank{rank}.json")
    if rank not in spec.group_ranks:  # a bystander of a sub-group case
        res["bystander"] = True
        out_path.write_text(json.dumps(res))
        return
    me = spec.group_ranks.index(rank)
    trusted = spec.case == "before_cached" or spec.capture_hops
    state = {"armed": False, "passes": 0, "calls": 0}
    try:
        for step in range(2):
            _step(spec, group, me, device, step, trusted, ring)
    except BaseException as exc:  # a healthy step failed: the case is broken, not the ring
        res["error"] = f"healthy step raised {type(exc).__name__}: {exc}"
        out_path.write_text(json.dumps(res))
        return
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    if rank == spec.victim:
        if spec.case.startswith("before"):
            store.set("fault/at", repr(time.time()))
            os._exit(0)
        _arm_victim(spec, store, state)
        state["armed"] = True
    else:
        if spec.case.startswith("before"):
            store.wait(["fault/at"], timedelta(seconds=60))
            time.sleep(_BEFORE_WAIT_S)  # the victim's sockets are closed by then
    res["call_at"] = time.time()
    try:
        _step(spec, group, me, device, 2, trusted, ring)
        if _host_wait() == "lag":
            # the next layer's ring call, as in training: a pass's end waits for the pass before
            _step(spec, group, me, device, 3, trusted, ring)
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        res["returned"] = True
    except RingPeerError as err:
        res["error_at"] = time.time()
        res["ring_peer_error"] = True
        res["message"] = str(err)
        res["fields"] = {"call": err.call, "peers": err.peers, "group_ranks": err.group_ranks,
                         "timeout_s": err.timeout_s}  # fmt: skip
        res["bad"] = _expectations(err, spec, rank)
    except BaseException as exc:  # the wrong error type is a failure of the case
        res["error_at"] = time.time()
        res["ring_peer_error"] = False
        res["message"] = f"{type(exc).__name__}: {exc}"
        res["trace"] = traceback.format_exc()[-2000:]
    if rank != spec.victim:
        try:
            res["fault_at"] = float(store.get("fault/at").decode())
        except Exception:  # the victim never reached its fault point
            res["fault_at"] = None
    out_path.write_text(json.dumps(res))


def _fork_child(spec: Spec, rank: int, host: str, port: int, prefix: str, outdir: str) -> None:
    """A forked rank of the gloo launcher: its own process group on the launcher's store."""
    import faulthandler

    code = 0
    # a rank still running past the launcher's patience leaves its stack here
    trace = open(Path(outdir, f"rank{rank}.stack.txt"), "w")  # noqa: SIM115 (lives until exit)
    faulthandler.dump_traceback_later(spec.timeout_s + SLACK_S + 30.0, exit=False, file=trace)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
        store = dist.PrefixStore(prefix, client)
        timeout = timedelta(seconds=spec.pg_timeout_s or spec.timeout_s)
        if spec.pg_timeout_s:
            os.environ["RELAYMOE_RING_TIMEOUT_S"] = str(spec.timeout_s)
        os.environ.update(dict(spec.env))
        dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank,
                                world_size=spec.world, timeout=timeout)  # fmt: skip
        group = dist.new_group(list(spec.group_ranks), timeout=timeout)
        rank_main(spec, rank, group, store, torch.device("cpu"), outdir)
    except BaseException:
        Path(outdir, f"rank{rank}.json").write_text(
            json.dumps({"rank": rank, "error": traceback.format_exc()[-2000:]})
        )
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: a process group with a dead peer may hang on destroy


# ---------------------------------------------------------------------------------------------
# a case's row from its ranks' files
# ---------------------------------------------------------------------------------------------
def row_of(spec: Spec, outdir: str, *, hung: list[int] | None = None, note: str = "") -> dict:
    hung = hung or []
    res = {}
    for r in range(spec.world):
        f = Path(outdir, f"rank{r}.json")
        if f.exists():
            res[r] = json.loads(f.read_text())
    why, detected, message = [], [], None
    for r in spec.group_ranks:
        if r == spec.victim:
            continue
        got = res.get(r)
        if got is None:
            why.append(f"survivor {r} " + ("hung" if r in hung else "died without a report"))
            continue
        if "error" in got:
            why.append(f"survivor {r}: {got['error'][-300:]}")
            continue
        if got.get("returned"):
            why.append(f"survivor {r} returned data")
            continue
        if not got.get("ring_peer_error"):
            why.append(f"survivor {r} raised the wrong error: {got.get('message', '')[:300]}")
            continue
        if got.get("bad"):
            why.append(f"survivor {r}: {'; '.join(got['bad'])}")
        start = max(got["call_at"], got.get("fault_at") or got["call_at"])
        detected.append(got["error_at"] - start)
        message = message or got.get("message")
    det = max(detected) if detected else None
    if det is not None and det > spec.timeout_s + SLACK_S:
        why.append(f"detected after {det:.1f} s > timeout {spec.timeout_s:g} + {SLACK_S:g} s")
    if note and why:  # how the job ended explains a missing or wrong report, no more: NCCL's
        why.append(note)  # watchdog may end a survivor (or the victim) after a correct report
    transport = "nccl" if spec.mode == "alltoall" else spec.transport
    extra = {}
    if spec.backend == "nccl":  # what NCCL's watchdog does at the timeout
        extra["nccl_error_handling"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "default")
        extra["host_wait"] = dict(spec.env).get(HOST_WAIT_ENV) or _host_wait()
    return {
        "bench": "fault",
        "case": spec.case,
        "transport": transport,
        "mode": spec.mode,
        "backend": spec.backend,
        "ep": len(spec.group_ranks),
        "world": spec.world,
        "timeout_s": spec.timeout_s,
        "pg_timeout_s": spec.pg_timeout_s or spec.timeout_s,
        "detected_s": None if det is None else round(det, 3),
        "ok": not why,
        "victim": spec.victim,
        "message": message,
        "why": "; ".join(why) or None,
        "launcher": note or None,
        **(
            {"schedule": spec.schedule, "gpus_per_node": spec.gpus_per_node}
            if spec.schedule != "auto"
            else {}
        ),
        **({"capture_hops": True} if spec.capture_hops else {}),
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
def run_local(specs: list[Spec], outdir: str, port: int, *, concurrency: int = 4) -> list[dict]:
    """Run gloo cases from THIS process by forking each case's ranks, on the TCPStore served at
    ``127.0.0.1:port`` by another process. Call it from a single-threaded process that has
    imported torch and relaymoe but run no torch ops (``run_isolated`` spawns one): a fork
    copies no other thread, so no lock another thread held can be inherited."""
    import multiprocessing as mp

    import relaymoe.ring  # noqa: F401  (imported before fork: children start warm)

    ctx = mp.get_context("fork")
    rows: list[dict | None] = [None] * len(specs)
    queue = list(enumerate(specs))
    running: list[tuple[int, Spec, str, list, float]] = []
    while queue or running:
        while queue and len(running) < concurrency:
            i, spec = queue.pop(0)
            case_dir = str(Path(outdir, f"{i:03d}-{spec.label()}"))
            Path(case_dir).mkdir(parents=True, exist_ok=True)
            procs = []
            for r in range(spec.world):
                args = (spec, r, "127.0.0.1", port, f"case{i}/", case_dir)
                p = ctx.Process(target=_fork_child, args=args)
                p.start()
                procs.append(p)
            running.append((i, spec, case_dir, procs, time.monotonic()))
        time.sleep(0.05)
        still = []
        for i, spec, case_dir, procs, t0 in running:
            survivors = [r for r in spec.group_ranks if r != spec.victim]
            survivors += [r for r in range(spec.world) if r not in spec.group_ranks]
            done = all(not procs[r].is_alive() for r in survivors)
            late = time.monotonic() - t0 > spec.timeout_s + SLACK_S + 45.0
            if done or late:
                hung = [r for r in survivors if procs[r].is_alive()]
                for p in procs:
                    if p.is_alive():
                        p.kill()
                    p.join()
                note = f"killed after {time.monotonic() - t0:.0f} s" if hung else ""
                rows[i] = row_of(spec, case_dir, hung=hung, note=note)
            else:
                still.append((i, spec, case_dir, procs, t0))
        running = still
    return [r for r in rows if r is not None]


def _isolated_main(
    specs_json: str, outdir: str, result_path: str, port: int, concurrency: int
) -> None:
    specs = [
        Spec(**{**s, "ep": tuple(s["ep"]), "env": tuple(tuple(kv) for kv in s["env"])})
        for s in json.loads(specs_json)
    ]
    rows = run_local(specs, outdir, port, concurrency=concurrency)
    Path(result_path).write_text(json.dumps(rows))


def run_isolated(specs: list[Spec], outdir: str, *, concurrency: int = 4,
                 deadline_s: float | None = None) -> list[dict]:  # fmt: skip
    """``run_local`` in a fresh spawned launcher (safe from a process that already ran torch
    ops, e.g. pytest), under one wall-clock deadline; this process serves the store."""
    import multiprocessing as mp

    import torch.distributed as dist

    Path(outdir).mkdir(parents=True, exist_ok=True)
    result = str(Path(outdir, "rows.json"))
    payload = json.dumps([asdict(s) for s in specs])
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))  # fmt: skip
    proc = mp.get_context("spawn").Process(
        target=_isolated_main, args=(payload, outdir, result, server.port, concurrency)
    )
    proc.start()
    if deadline_s is None:
        rounds = -(-len(specs) // concurrency)
        deadline_s = 60.0 + rounds * (max(s.timeout_s for s in specs) + SLACK_S + 50.0)
    proc.join(deadline_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"the fault launcher ran past {deadline_s:.0f} s")
    if not Path(result).exists():
        raise RuntimeError(f"the fault launcher died (exit code {proc.exitcode})")
    return json.loads(Path(result).read_text())


def run_torchrun(specs: list[Spec], outdir: str, *, concurrency: int = 1) -> list[dict]:
    """NCCL: one ``torchrun`` job per case (this machine's GPUs), each under a wall-clock cap;
    ``concurrency`` jobs at once (``--standalone`` gives each its own rendezvous port)."""
    import signal
    import subprocess
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.processes import stop_group

    running: set = set()
    lock = threading.Lock()

    def stop_all(signum, frame):  # the caller's SIGTERM (a suite limit): no orphaned cases
        with lock:
            procs = list(running)
        for p in procs:
            stop_group(p, grace_s=5)
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop_all)

    def one(i: int, spec: Spec) -> dict:
        case_dir = Path(outdir, f"{i:03d}-{spec.label()}")
        case_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={spec.world}", str(Path(__file__).resolve()), "--one",
               "--backend", spec.backend, "--case", spec.case, "--mode", spec.mode,
               "--transport", spec.transport, "--timeout", str(spec.timeout_s),
               "--schedule", spec.schedule, "--gpus-per-node", str(spec.gpus_per_node or 0),
               "--outdir", str(case_dir)]  # fmt: skip
        cap = spec.timeout_s + SLACK_S + CASE_OVERHEAD_S
        note = ""
        t0 = time.monotonic()
        # its own session: a survivor still hung at the cap is killed with its torchrun, never
        # left spinning on the GPU under the next case
        with open(Path(case_dir, "torchrun.log"), "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, **dict(spec.env)),
                                    start_new_session=True)  # fmt: skip
            with lock:
                running.add(proc)
            try:
                if proc.wait(timeout=cap):
                    note = f"torchrun exit code {proc.returncode} (see {case_dir}/torchrun.log)"
            except subprocess.TimeoutExpired:
                stop_group(proc)
                note = f"still running at the {cap:.0f} s cap (killed)"
            finally:
                with lock:
                    running.discard(proc)
        hung = [r for r in spec.group_ranks if not Path(case_dir, f"rank{r}.json").exists()]
        row = row_of(spec, str(case_dir), hung=hung if note else [], note=note)
        row["wall_s"] = round(time.monotonic() - t0, 1)
        row["concurrency"] = concurrency
        print(json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, range(len(specs)), specs))


def _torchrun_one(args) -> int:
    """One case under torchrun: NCCL with one GPU per rank, or gloo on CPU."""
    import faulthandler

    import torch
    import torch.distributed as dist

    # no autotuner search: on a cold Triton cache it alone outlasted the case's cap (H200)
    os.environ.setdefault("RELAYMOE_AUTOTUNE", "0")  # read by rank_main (options.from_env)
    local = int(os.environ.get("LOCAL_RANK", 0))
    timeout = timedelta(seconds=args.timeout)
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    # a rank still running past the launcher's patience leaves its stacks here
    trace = open(Path(args.outdir, f"rank{local}.stack.txt"), "w")  # noqa: SIM115 (until exit)
    faulthandler.dump_traceback_later(
        args.timeout + SLACK_S + CASE_OVERHEAD_S - 10.0, exit=False, file=trace
    )
    if args.backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = Spec(case=args.case, mode=args.mode, transport=args.transport, world=world,
                timeout_s=args.timeout, backend=args.backend, schedule=args.schedule,
                gpus_per_node=args.gpus_per_node or None)  # fmt: skip
    group = dist.new_group(list(spec.group_ranks), timeout=timeout)
    store = dist.distributed_c10d._get_default_store()
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    rank_main(spec, rank, group, store, device, args.outdir)
    sys.stdout.flush()
    os._exit(0)


def default_specs(worlds, timeout_s: float, *, transports=("nccl",), backend="gloo",
                  cases=CASES, modes=MODES, host_waits=(None,)) -> list[Spec]:  # fmt: skip
    """Every (world, case, mode, transport[, host wait]) combination; the all-to-all mode runs on
    NCCL P2P only. ``host_waits``: values of ``RELAYMOE_RING_HOST_WAIT`` (None: inherited)."""
    specs = []
    for world in worlds:
        for case in cases:
            for mode in modes:
                for tr in transports if mode != "alltoall" else ("nccl",):
                    for hw in host_waits:
                        env = ((HOST_WAIT_ENV, hw),) if hw else ()
                        specs.append(Spec(case=case, mode=mode, transport=tr, world=world,
                                          timeout_s=timeout_s, backend=backend,
                                          env=env))  # fmt: skip
    return specs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--timeout", type=float, default=5.0, help="process group timeout (s)")
    ap.add_argument("--world", default=None, help="world sizes, e.g. 2,3 (gloo default 2,3)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--transports", default=None, help="nccl,copy_engine (GPU default both)")
    ap.add_argument("--concurrency", type=int, default=4, help="cases run at once")
    waits = f"{HOST_WAIT_ENV} values, each a set of cases (e.g. off,pass; on CPU the ring always "
    ap.add_argument("--host-wait", default="", help=waits + "waits); default: the environment's")
    ap.add_argument(
        "--launcher",
        choices=("fork", "torchrun"),
        default=None,
        help="fork (gloo default) or one torchrun job per case (nccl default)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fault.jsonl"))
    ap.add_argument("--workdir", default=None, help="per-rank files (default: a temp dir)")
    # one case under torchrun
    ap.add_argument("--one", action="store_true", help="run one case (under torchrun)")
    ap.add_argument("--case", choices=CASES)
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--transport", default="nccl")
    ap.add_argument(
        "--schedule",
        default="auto",
        help="ring_moe's schedule for every case (node_batched: expert mode only)",
    )
    ap.add_argument("--gpus-per-node", type=int, default=0, help="with --schedule (0: hosts)")
    ap.add_argument("--outdir")
    args = ap.parse_args(argv)
    if args.one:
        return _torchrun_one(args)

    import tempfile

    from benchmarks.common import JsonlWriter, print_table

    worlds = [int(w) for w in (args.world or ("2,3" if args.backend == "gloo" else "2")).split(",")]
    transports = args.transports or ("nccl" if args.backend == "gloo" else "nccl,copy_engine")
    specs = default_specs(worlds, args.timeout, transports=tuple(transports.split(",")),
                          backend=args.backend, cases=tuple(args.cases.split(",")),
                          modes=tuple(args.modes.split(",")),
                          host_waits=tuple(args.host_wait.split(",")) if args.host_wait
                          else (None,))  # fmt: skip
    if args.schedule != "auto":  # e.g. --schedule node_batched --gpus-per-node 1 --modes expert
        specs = [replace(s, schedule=args.schedule, gpus_per_node=args.gpus_per_node or None)
                 for s in specs]  # fmt: skip
    workdir = args.workdir or tempfile.mkdtemp(prefix="relaymoe_fault_")
    t0 = time.monotonic()
    launcher = args.launcher or ("fork" if args.backend == "gloo" else "torchrun")
    if launcher == "fork":
        if args.backend != "gloo":
            raise SystemExit("--launcher fork runs gloo only; NCCL cases need --launcher torchrun")
        rows = run_isolated(specs, workdir, concurrency=args.concurrency)
    else:
        rows = run_torchrun(specs, workdir, concurrency=args.concurrency)
    writer = JsonlWriter(args.out)
    for row in rows:
        writer.write(row)
    print_table(rows, ["case", "mode", "transport", "backend", "host_wait", "ep", "timeout_s",
                       "detected_s", "ok", "why"])  # fmt: skip
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} ok in {time.monotonic() - t0:.0f} s; rows in "
          f"{args.out}; per-rank files in {workdir}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
