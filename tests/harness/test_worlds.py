"""The persistent spawned worlds the ring scenarios run in (tests/worlds.py, the ``gloo_worlds``
fixture): a world serves scenario after scenario; a scenario that fails on one rank, kills a rank
or hangs fails with that rank's traceback, its exit code or the ranks that hung, within its
timeout; the world is then killed and a fresh one serves the next scenario; nothing is left
running. And the ports they meet on."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.fixtures import World, Worlds, free_port, run_python


def _all_reduce(rank, world, group):
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == world


def _fails_on_the_last_rank(rank, world, group):
    if rank == world - 1:
        raise ValueError(f"broken on purpose on rank {rank}")


def _first_rank_exits(rank, world, group):
    if rank == 0:
        os._exit(3)


def _first_rank_hangs(rank, world, group):
    if rank == 0:
        time.sleep(3600)


def _gone(procs) -> bool:
    for p in procs:
        try:
            os.kill(p.pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_a_world_serves_scenarios_until_one_fails_then_a_fresh_one_does():
    worlds = Worlds()
    try:
        worlds.run(_all_reduce, 2, timeout=60)
        (first,) = worlds._worlds.values()
        worlds.run(_all_reduce, 2, timeout=60)
        assert list(worlds._worlds.values()) == [first]  # the same ranks served again
        with pytest.raises(AssertionError) as info:
            worlds.run(_fails_on_the_last_rank, 2, timeout=60)
        msg = str(info.value)
        assert "_fails_on_the_last_rank failed in a world of 2" in msg, msg
        assert "rank 1: Traceback" in msg and "ValueError: broken on purpose on rank 1" in msg
        assert "rank 0:" not in msg  # rank 0 passed
        assert not worlds._worlds and _gone(first.procs)  # out of step: killed, not kept
        worlds.run(_all_reduce, 2, timeout=60)
        (fresh,) = worlds._worlds.values()
        assert fresh is not first
    finally:
        worlds.close()
    assert _gone(fresh.procs)


def test_a_hung_scenario_fails_within_its_timeout_and_its_world_is_killed():
    world = World(2)
    start = time.monotonic()
    msg = world.run(_first_rank_hangs, timeout=3)
    assert time.monotonic() - start < 15
    assert "ranks [0] gave no answer within 3 s (hung): world killed" in msg, msg
    assert not world.alive and _gone(world.procs)


def test_a_rank_that_dies_is_named_with_its_exit_code():
    world = World(2)
    msg = world.run(_first_rank_exits, timeout=60)
    assert "rank 0: died (exit code 3)" in msg, msg
    assert _gone(world.procs)


def test_ports_are_handed_out_once_below_the_ephemeral_range(monkeypatch):
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:
        pass
    assert all(p < low for p in ports), ports
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    other = {free_port() for _ in range(50)}
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    mine = {free_port() for _ in range(50)}
    assert max(mine) < min(other)  # each xdist worker in a block of its own


def test_run_python_is_python_with_its_arguments_environment_streams_and_status(tmp_path):
    """``run_python`` (a forked interpreter that has imported torch) behaves as ``python ARGS``
    for what the tests' scripts use: argv, the working directory, the given environment (and no
    other), stdin, stdout, stderr, the exit status of SystemExit or an exception, a timeout."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "print('ARGV', sys.argv[1:], os.getcwd(), os.environ.get('RUN_PY'), 'HOME' in os.environ)\n"
        "print('IN', sys.stdin.read())\n"
        "print('ERR', file=sys.stderr)\n"
        "assert sys.path[0] == ''\n"
        "raise SystemExit(int(sys.argv[2]))\n"
    )
    r = run_python(["-c", code, "a b", "3"], timeout=120, cwd=tmp_path, input="piped",
                   env={"RUN_PY": "1", "PATH": os.environ["PATH"]})  # fmt: skip
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert f"ARGV ['a b', '3'] {tmp_path} 1 False" in r.stdout and "IN piped" in r.stdout
    assert r.stderr.strip() == "ERR" and r.args[0] == sys.executable
    script = tmp_path / "s.py"
    script.write_text("import sys\nassert sys.path[0] == sys.argv[1]\nraise ValueError('bad')\n")
    r = run_python([str(script), str(tmp_path)], timeout=120)
    assert r.returncode == 1 and "ValueError: bad" in r.stderr, r.stderr
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; time.sleep(60)"], timeout=2)
    assert time.monotonic() - start < 30
