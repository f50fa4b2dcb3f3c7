"""Spawned processes for the tests: ports, one-shot worlds, and the persistent worlds the ring
scenarios run in (``World``, ``Worlds``: the ``gloo_worlds`` fixture of ``tests/conftest.py``).
Tests import these through ``tests.fixtures``; this module needs only torch. On the CPU the
processes fork from a forkserver that has imported torch and Megatron (``_context``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import importlib
import itertools
import os
import random
import signal
import socket
import sys
import time
import traceback
import uuid
from multiprocessing import connection as mp_connection

import torch
import torch.multiprocessing as mp

# Ports for rendezvous come from a fixed range below the kernel's ephemeral ports (32768 and up
# on Linux: what bind(0) and gloo's own connections get), a block of its own per pytest-xdist
# worker, each port handed out once per process from a random start: two workers, two worlds of
# one worker, or two test runs at once never race for a port.
_PORT_BASE, _PORT_BLOCK, _PORT_BLOCKS = 20000, 1000, 12
_port_offsets = itertools.count(random.randrange(_PORT_BLOCK))


def free_port() -> int:
    """A TCP port on localhost for a spawned process group's rendezvous (free when asked)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw<N>" under pytest-xdist
    block = int(worker[2:]) % _PORT_BLOCKS if worker[2:].isdigit() else 0
    for _ in range(_PORT_BLOCK):
        port = _PORT_BASE + block * _PORT_BLOCK + next(_port_offsets) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use by someone else: the next one
                continue
        return port
    raise RuntimeError(f"no free port in block {block} of {_PORT_BASE}+")


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that spawned it dies (a killed pytest
    leaves no ranks behind)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# How processes start. Without CUDA (the CPU suite) they fork from a forkserver (one per test
# process, started on first use) that has imported torch and Megatron: each of the dozens of ranks
# the suite starts saves those imports (seconds of CPU each); and Hugging Face's transformers,
# which about twenty of the processes import (the conversions' ranks, their checks, the
# preflights with a tokenizer: half a second each). Nothing else is imported there: relaymoe,
# the tests' modules and what the scenarios import come afresh in every process.
# With CUDA (the GPU suites) processes are spawned.
_FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    # Megatron's ranks (tests/lib/test_megatron_layer.py and the like); where it is missing the
    # forkserver goes without (an ImportError in a preload is skipped)
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.moe_module_specs",
    "transformers",
]
# The environment the forkserver starts with: the session's, whatever test starts the first
# process (each process then gets its starter's environment: ``_child``).
_SESSION_ENV = dict(os.environ)


def _context():
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    with _environment(_SESSION_ENV):
        forkserver.ensure_running()  # at once when it runs
    return ctx


@contextlib.contextmanager
def _environment(env: dict):
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def _child(target, args, env, leave_at_once: bool) -> None:
    _die_with_parent()
    # The environment of the process that started this one, at the start, as a spawned process
    # has it (a forked one has the forkserver's): an entry point here reads its options from it.
    os.environ.clear()
    os.environ.update(env)
    if target is not _python_main and os.environ.get("TRITON_INTERPRET") == "1":
        from tests import triton_interpreter  # the interpreter's bookkeeping cached, as in pytest

        triton_interpreter.install()
    target(*args)  # raises: multiprocessing reports it, exit code 1
    if not leave_at_once:
        return
    # Done (a forked process): leave at once. The interpreter's own shutdown with torch, triton
    # and Megatron loaded takes a second or more of each process's CPU for nothing, and
    # World.close waits for it.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _start(target, args_per_process, *, daemon=False) -> list:
    """Start ``target(*args)`` in a new process per entry of ``args_per_process``."""
    ctx, env = _context(), dict(os.environ)
    forked = ctx.get_start_method() == "forkserver"
    procs = [ctx.Process(target=_child, args=(target, a, env, forked), daemon=daemon)
             for a in args_per_process]  # fmt: skip
    for p in procs:
        p.start()
    return procs


def _kill_after(procs, deadline: float) -> list[int]:
    """Wait for ``procs`` until ``deadline`` (``time.monotonic``), then kill the ones still alive;
    returns their indices."""
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    late = [i for i, p in enumerate(procs) if p.is_alive()]
    for i in late:
        procs[i].kill()
        procs[i].join()
    return late


def run_spawned(target, args_of_rank, world: int, timeout: float) -> tuple[list[int], list]:
    """Start ``target(*args_of_rank(r))`` for every rank in spawned processes under one deadline
    for the whole world; kill what is still alive then. Returns (ranks that hung, exit codes)."""
    procs = _start(target, [args_of_rank(r) for r in range(world)])
    hung = _kill_after(procs, time.monotonic() + timeout)
    return hung, [p.exitcode for p in procs]


# ---------------------------------------------------------------------------------------------
# ``python ARGS`` in a process started like the worlds' ranks
# ---------------------------------------------------------------------------------------------
def _python_main(args, cwd, stdin_path, stdout_path, stderr_path) -> None:
    """What ``python ARGS`` does (``-c CODE [ARG...]``, ``-m MODULE [ARG...]`` or ``SCRIPT
    [ARG...]``) in ``cwd``, its standard streams on the given files; leaves with its exit
    status."""
    import runpy
    import types

    for fd, path, flags in ((0, stdin_path, os.O_RDONLY), (1, stdout_path, os.O_WRONLY),
                            (2, stderr_path, os.O_WRONLY)):  # fmt: skip
        f = os.open(path, flags)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (multiprocessing gave it /dev/null)
    os.chdir(cwd)
    # sys.path as the interpreter starts it: the script's directory ("" for -c, the working
    # directory for -m), then PYTHONPATH, before what this process had
    first = {"-c": "", "-m": cwd}.get(args[0], os.path.dirname(os.path.abspath(args[0])))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [first, *extra]
    code = 0
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class PythonProcess:
    """``python ARGS`` started by ``start_python``: ``communicate(timeout)``, ``returncode``,
    ``kill()``, as a ``subprocess.Popen`` with text pipes has them."""

    def __init__(self, args, *, env=None, cwd=None, input: str | None = None):
        import tempfile

        self.args = [sys.executable, *args]
        self._dir = tempfile.TemporaryDirectory(prefix="python-")
        self._paths = [os.path.join(self._dir.name, n) for n in ("stdin", "stdout", "stderr")]
        with open(self._paths[0], "w") as f:
            f.write(input or "")
        for path in self._paths[1:]:
            open(path, "w").close()
        cwd = os.path.abspath(cwd or os.getcwd())
        with _environment(dict(os.environ) if env is None else dict(env)):
            (self._proc,) = _start(_python_main, [(list(args), cwd, *self._paths)])
        self.returncode = None

    def kill(self) -> None:
        self._proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        import subprocess

        self._proc.join(timeout)
        out, err = (open(p, errors="replace").read() for p in self._paths[1:])
        if self._proc.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout, out, err)
        self.returncode = self._proc.exitcode
        self._dir.cleanup()
        return out, err


def start_python(args, *, env=None, cwd=None, input: str | None = None) -> PythonProcess:
    """``python ARGS`` (``args`` without the interpreter) in a new process with environment
    ``env`` (default: this one's) and working directory ``cwd``. Without CUDA it forks from the
    forkserver that has imported torch and Megatron (``_context``): a script that imports them
    starts seconds sooner, which is all it changes; a test of what a fresh interpreter imports,
    or of a command line, runs ``sys.executable`` itself."""
    return PythonProcess(args, env=env, cwd=cwd, input=input)


def run_python(args, *, timeout: float, env=None, cwd=None, input: str | None = None):
    """``start_python`` and wait, as ``subprocess.run(..., capture_output=True, text=True)``
    does: a ``CompletedProcess``; past ``timeout`` the process is killed and
    ``subprocess.TimeoutExpired`` raised."""
    import subprocess

    p = start_python(args, env=env, cwd=cwd, input=input)
    try:
        out, err = p.communicate(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


# ---------------------------------------------------------------------------------------------
# What a world of processes left running after its ranks exited
# ---------------------------------------------------------------------------------------------
# An environment variable relaymoe never reads. Ranks started with it (``run_world(mark=)``)
# pass it on to every process they spawn (an environment is inherited), so once they have
# exited, a live process carrying it is one they left behind, wherever it was reparented; the
# token makes it this test process's and no other session's.
WORLD_MARK = "RELAYMOE_TEST_WORLD"
_MARK_TOKEN = uuid.uuid4().hex


def world_mark(what) -> str:
    """The ``WORLD_MARK`` of the world that makes ``what`` (a folder, say) in this test
    process."""
    return f"{_MARK_TOKEN}:{what}"


def processes_marked(mark: str) -> dict[int, str]:
    """pid: command line of each live process of this user started with ``WORLD_MARK=mark`` in
    its environment (Linux's /proc; a process that only set it later does not show it there)."""
    entry = f"{WORLD_MARK}={mark}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended meanwhile, or another user's
            continue
    return found


def end_left_running(mark: str, *, wait_s: float = 5.0) -> dict[int, str]:
    """What the world of ``mark`` left running (``processes_marked``) once it had ``wait_s`` to
    end on its own (a resource tracker ends an instant after the last process writing to it);
    each process left is then killed, by its pid (it carries this test process's mark), so that
    none outlives the test that finds it."""
    deadline = time.monotonic() + wait_s
    while (left := processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def _init_world(rank: int, world: int, port: int, pg_timeout_s: float, backend: str):
    """This rank's process group, and an explicit group of all ranks (not the default one)."""
    from datetime import timedelta

    import torch.distributed as dist

    device_id = None
    if backend == "nccl":  # rank r on GPU r
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=pg_timeout_s), device_id=device_id,
    )  # fmt: skip
    return dist.new_group(list(range(world)))


def _world_rank(rank, world, port, conn, pg_timeout_s, backend) -> None:
    """One rank of a ``World``: set up, answer None (ready) or a traceback, then run each
    ``(module, name)`` it is sent as ``fn(rank, world, group)`` and answer None or the traceback,
    until it is sent None or its parent goes away."""
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        group = _init_world(rank, world, port, pg_timeout_s, backend)
    except Exception:
        conn.send(traceback.format_exc())
        return
    conn.send(None)
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            break
        if request is None:
            break
        try:
            module, name = request
            fn = functools.reduce(getattr, name.split("."), importlib.import_module(module))
            fn(rank, world, group)
            answer = None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # pytest.fail and friends too
            answer = traceback.format_exc()
        conn.send(answer)
    dist.destroy_process_group()


class World:
    """``size`` spawned ranks in one process group (``backend`` gloo, or nccl: rank r on GPU r),
    kept alive between scenarios. ``run(fn, timeout)`` runs the module-level function
    ``fn(rank, world, group)`` on every rank (``group``: an explicit group of all ranks) and
    returns None, or what went wrong: each failing rank's traceback, the ranks that died, the ranks
    still running at ``timeout``. A world that failed a scenario is killed (its ranks may be out of
    step) and not used again."""

    START_TIMEOUT_S = 180.0

    def __init__(self, size: int, *, backend: str = "gloo", pg_timeout_s: float = 30):
        self.size, self.backend, self.pg_timeout_s = size, backend, pg_timeout_s
        pipes = [mp_connection.Pipe() for _ in range(size)]
        port = free_port()
        args = [(r, size, port, child, pg_timeout_s, backend) for r, (_, child) in enumerate(pipes)]
        self.procs = _start(_world_rank, args, daemon=True)
        self.conns = [parent for parent, _ in pipes]
        for _, child in pipes:
            child.close()
        trouble = self._report("setup", self._answers(self.START_TIMEOUT_S), self.START_TIMEOUT_S)
        if trouble:
            raise RuntimeError(trouble)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, timeout: float) -> str | None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a rank that died: reported by _answers
                conn.send((fn.__module__, fn.__qualname__))
        return self._report(fn.__name__, self._answers(timeout), timeout)

    def _answers(self, timeout: float) -> dict[int, str | None]:
        """Each rank's answer (None: ok) within ``timeout``; a rank without one is missing. Once a
        rank has failed, the others get the process group's timeout (plus slack) to fail too."""
        deadline = time.monotonic() + timeout
        answers, waiting = {}, dict(enumerate(self.conns))
        while waiting:
            left = deadline - time.monotonic()
            sentinels = [self.procs[r].sentinel for r in waiting]
            if left <= 0 or not mp_connection.wait([*waiting.values(), *sentinels], left):
                break
            for r, conn in list(waiting.items()):
                if conn.poll():  # an answer, or the end of the pipe of a rank that died
                    try:
                        answers[r] = conn.recv()
                    except EOFError:
                        self.procs[r].join(5)
                        answers[r] = f"died (exit code {self.procs[r].exitcode})"
                    del waiting[r]
            if any(a is not None for a in answers.values()):
                deadline = min(deadline, time.monotonic() + self.pg_timeout_s + 10)
        return answers

    def _report(self, what: str, answers: dict, timeout: float) -> str | None:
        hung = [r for r in range(self.size) if r not in answers]
        failed = {r: a for r, a in answers.items() if a is not None}
        if not hung and not failed:
            return None
        self.kill()
        lines = [f"{what} failed in a world of {self.size} ({self.backend})"]
        if hung:
            lines.append(f"ranks {hung} gave no answer within {timeout:.0f} s (hung): world killed")
        lines += [f"rank {r}: {a}" for r, a in sorted(failed.items())]
        return "\n".join(lines)

    def close(self, grace_s: float = 10.0) -> None:
        """Ask every rank to leave, then kill the ones that have not after ``grace_s``."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        _kill_after(self.procs, time.monotonic() + grace_s)
        for conn in self.conns:
            conn.close()

    def kill(self) -> None:
        _kill_after(self.procs, time.monotonic())
        for conn in self.conns:
            conn.close()


class Worlds:
    """The persistent worlds of a test session, one per (owner, size, backend, process-group
    timeout); the owner is the scenario's module, so a world serves one test file's scenarios as
    a spawned world per file used to. At most ``live`` worlds are kept (the least recently used
    is closed first); a world that failed is replaced by a fresh one."""

    def __init__(self, live: int = 2):
        self.live = live
        self._worlds: collections.OrderedDict = collections.OrderedDict()

    def run(self, fn, size: int, *, timeout: float, pg_timeout_s: float = 30,
            backend: str = "gloo") -> None:  # fmt: skip
        """``fn(rank, size, group)`` on every rank of the world; AssertionError with every
        failing rank's traceback when it fails on any rank, dies or runs past ``timeout``."""
        __tracebackhide__ = True
        key = (fn.__module__, size, backend, pg_timeout_s)
        world = self._worlds.pop(key, None)
        if world is None or not world.alive:
            while len(self._worlds) >= self.live:
                self._worlds.popitem(last=False)[1].close()
            world = self._start(size, backend, pg_timeout_s)
        failure = world.run(fn, timeout)
        if failure is not None:
            raise AssertionError(failure)
        self._worlds[key] = world

    @staticmethod
    def _start(size: int, backend: str, pg_timeout_s: float) -> World:
        for attempt in range(3):
            try:
                return World(size, backend=backend, pg_timeout_s=pg_timeout_s)
            except RuntimeError as err:  # the port taken between free_port and the bind: again
                if attempt == 2 or "address already in use" not in str(err).lower():
                    raise

    def close(self) -> None:
        while self._worlds:
            self._worlds.popitem()[1].close()


def scenario_params(scenarios, sizes) -> list:
    """``pytest.mark.parametrize(("world", "scenario"), ...)`` values: one item per (scenario,
    world size), named ``w<size>-<scenario>`` (``-k <scenario>`` selects one), in world-size
    order and, per size, in ``scenarios``' order (the order they run in their world). Under
    pytest-xdist (``--dist loadgroup``) a world's items run on one worker."""
    import pytest

    return [
        pytest.param(size, fn, id=f"w{size}-{fn.__name__.lstrip('_')}",
                     marks=pytest.mark.xdist_group(f"{fn.__module__}-w{size}"))
        for size in sizes for fn in scenarios
    ]  # fmt: skip


def run_scenarios(scenarios, world: int, *, timeout: float, pg_timeout_s: int = 30,
                  backend: str = "gloo") -> None:  # fmt: skip
    """Every ``fn(rank, world, group)`` of ``scenarios`` (module-level functions) in one spawned
    world of ``world`` ranks, ``timeout`` seconds each (a world that fails one is replaced for the
    rest); fails the calling test with every failure when any scenario failed (the GPU suites'
    single-item form of the ``gloo_worlds`` fixture)."""
    worlds, failures = Worlds(live=1), []
    try:
        for fn in scenarios:
            try:
                worlds.run(fn, world, timeout=timeout, pg_timeout_s=pg_timeout_s, backend=backend)
            except (AssertionError, RuntimeError) as err:
                failures.append(str(err))
    finally:
        worlds.close()
    assert not failures, "\n".join(failures)
