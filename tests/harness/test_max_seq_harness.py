"""benchmarks/max_seq.py (the measured longest sequence) and benchmarks/sdpa_attention.py.

On CPU: the bisection against fake trials (OOM thresholds, timeouts, a budget cut, errors), the
log classification, the job launcher's clean-up, the dry run, a whole (faked) run's rows, the
SDPA core attention against a float64 oracle, and a GPT model built through Megatron's parser
from the harness's own flags, whose attention matches megatron-core's local one.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from benchmarks import max_seq as ms
from tests.fixtures import MEGATRON_CPU_PRELUDE, needs, run_python

pytestmark = needs("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
STEP = ms.SEQ_STEP


# -- the search ---------------------------------------------------------------------------------


def fake_trials(fits_up_to: int, *, timeout_above: int | None = None, error_at=(), wall=100.0):
    """A trial function: ok up to ``fits_up_to`` tokens, OOM above, ``timeout`` above
    ``timeout_above`` (checked first), ``error`` at the given sequences. Records its calls."""
    calls = []

    def run(seq: int, timeout_s: float) -> ms.Trial:
        calls.append((seq, timeout_s))
        if seq in error_at:
            return ms.Trial(seq, "error", 1.0, detail="unrecognized arguments: --bogus")
        if timeout_above is not None and seq > timeout_above:
            return ms.Trial(seq, "timeout", timeout_s, detail="no result")
        if seq <= fits_up_to:
            return ms.Trial(seq, "ok", wall, peak_MiB=seq / 1000)
        return ms.Trial(seq, "oom", wall / 2, detail="torch.OutOfMemoryError: CUDA out of memory")

    run.calls = calls
    return run


def search(run, start, **kw):
    kw.setdefault("max_trial_s", 1000.0)
    kw.setdefault("estimate_s", lambda s: 10.0)
    kw.setdefault("log", lambda s: None)
    return ms.search_max_seq(run, start=start, **kw)


def assert_consistent(res: ms.SearchResult):
    """Every trial is a multiple of the step; no trial lies above a failure that came before it
    or below an earlier success (the search never contradicts what it measured)."""
    best_ok, least_fail = 0, math.inf
    for t in res.trials:
        assert t.seq % STEP == 0 and t.seq > 0, t
        assert best_ok < t.seq < least_fail, (t, best_ok, least_fail)
        if t.ok:
            best_ok = t.seq
        elif t.reason in ("oom", "timeout"):
            least_fail = t.seq


@pytest.mark.parametrize(
    "truth, start",
    [
        (600_000, 598_016),  # the planner within 1%
        (600_000, 540_672),  # 10% low
        (600_000, 659_456),  # 10% high
        (110_000, 1_100_000),  # 10x high
        (110_000, 11_000),  # 10x low
        (4096, 40_000),  # only the smallest fits
        (8191, 4096),  # the start itself is the answer
    ],
)
def test_search_finds_the_largest_fitting_multiple_of_the_step(truth, start):
    run = fake_trials(truth)
    res = search(run, start)
    want = truth // STEP * STEP
    assert res.max_seq == want, [(t.seq, t.reason) for t in res.trials]
    assert res.first_oom_seq == want + STEP
    assert (res.upper_seq, res.upper_reason) == (want + STEP, "oom")
    assert not res.bracket_open and res.stop_reason == "converged" and res.error is None
    assert_consistent(res)
    assert res.trials[0].seq == max(STEP, start // STEP * STEP)  # seeded by the prediction
    assert len(res.trials) <= 12  # geometric bracketing: even 10x off costs a few trials
    assert all(t.est_s == 10.0 and t.timeout_s == 1000.0 for t in res.trials)


def test_search_is_cheap_when_the_prediction_is_close():
    # within 10%: the first trial, one or two bracket moves, then bisection of a 1/8 gap
    for truth in (560_000, 600_000, 640_000):
        res = search(fake_trials(truth), 598_016)
        assert res.max_seq == truth // STEP * STEP
        assert len(res.trials) <= 8, [t.seq for t in res.trials]


def test_the_printed_ladder_is_what_the_search_tries():
    start = 548_864
    up, down = ms.ladder(start, STEP)
    assert [t.seq for t in search(fake_trials(10**9), start).trials][1:4] == up
    assert [t.seq for t in search(fake_trials(0), start).trials][1:4] == down


def test_search_reports_none_fits_when_the_smallest_sequence_fails():
    res = search(fake_trials(100), 50_000)
    assert res.max_seq == 0 and res.first_oom_seq == STEP
    assert res.stop_reason == "none_fits" and not res.bracket_open
    assert res.trials[-1].seq == STEP
    assert_consistent(res)


def test_a_timeout_bounds_the_search_but_is_not_an_oom():
    # fits up to 700k but anything above 500k is too slow to measure
    res = search(fake_trials(700_000, timeout_above=500_000), 598_016)
    assert res.max_seq == 500_000 // STEP * STEP
    assert res.first_oom_seq is None
    assert res.upper_reason == "timeout" and res.bracket_open
    assert res.stop_reason == "timeout_bound"
    assert_consistent(res)
    # an OOM below the timeouts still closes the bracket
    res = search(fake_trials(300_000, timeout_above=500_000), 598_016)
    assert res.max_seq == 300_000 // STEP * STEP and res.first_oom_seq == res.max_seq + STEP
    assert not res.bracket_open and res.stop_reason == "converged"
    assert any(t.reason == "timeout" for t in res.trials)


def test_an_error_stops_the_search_and_is_shown():
    run = fake_trials(600_000, error_at=(675_840,))
    res = search(run, 598_016)
    assert res.stop_reason == "error" and res.bracket_open
    assert "unrecognized arguments" in res.error
    assert [t.seq for t in res.trials] == [598_016, 675_840]  # nothing after the error
    assert res.max_seq == 598_016 and res.first_oom_seq is None


def test_the_budget_cuts_the_search_and_leaves_the_bracket_open():
    now = [0.0]

    def clock():
        return now[0]

    inner = fake_trials(600_000)

    def run(seq, timeout_s):
        now[0] += 400.0  # every trial takes 400 s of wall time
        return inner(seq, timeout_s)

    res = search(run, 540_672, budget_s=1000.0, estimate_s=lambda s: 300.0, clock=clock)
    # 0 s: 1000 left -> trial; 400: 600 left -> trial; 800: 200 left < 300 estimated -> stop
    assert len(res.trials) == 2 and res.stop_reason == "budget" and res.bracket_open
    assert res.max_seq == max(t.seq for t in res.trials if t.ok)
    # the second trial's timeout is the budget left when it started, not --max-trial-s
    assert [t.timeout_s for t in res.trials] == [1000.0, 600.0]


def test_a_trial_cut_by_the_budget_is_not_a_timeout_bound():
    now = [0.0]
    inner = fake_trials(600_000, timeout_above=0)  # every trial times out

    def run(seq, timeout_s):
        now[0] += timeout_s
        return inner(seq, timeout_s)

    res = search(run, 598_016, budget_s=500.0, max_trial_s=1000.0, clock=lambda: now[0])
    assert [t.reason for t in res.trials] == ["budget"]
    assert "budget" in res.trials[0].detail
    assert res.stop_reason == "budget" and res.upper_seq is None and res.max_seq == 0


def test_the_search_stops_at_the_sequence_limit():
    res = search(fake_trials(10**9), 598_016, limit=1 << 20)
    assert res.max_seq == 1 << 20 and res.stop_reason == "limit" and res.bracket_open
    assert_consistent(res)


def test_search_refuses_a_bad_step():
    with pytest.raises(ValueError, match="step"):
        search(fake_trials(1), 4096, step=0)


# -- trial outcomes ----------------------------------------------------------------------------

OOM_LOG = (
    """\
[rank0]: iteration 1 ...
[rank1]: Traceback (most recent call last):
[rank1]:   File "x.py", line 3, in forward
[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 18.50 GiB. GPU 1 has a \
total capacity of 139.81 GiB of which 9.25 GiB is free. Of the allocated memory 121.75 GiB is \
allocated by PyTorch, and 6.10 GiB is reserved by PyTorch but unallocated.
[rank0]: [E ProcessGroupNCCL.cpp] Watchdog caught collective operation timeout
"""
    + "torchrun noise\n" * 200
)

OK_STEPS = [{"step": 1, "loss": 11.9, "step_s": 70.0, "peak_MiB": 120_000.0},
            {"step": 2, "loss": 11.8, "step_s": 50.0, "peak_MiB": 121_000.5}]  # fmt: skip


def classify(**kw):
    base = dict(returncode=0, timed_out=False, timeout_s=600.0, steps=OK_STEPS, log=ms.SDPA_MARKER,
                expected_steps=2, marker=ms.SDPA_MARKER)  # fmt: skip
    return ms.classify(**{**base, **kw})


def test_classify_outcomes():
    assert classify() == ("ok", "")
    # OOM on either rank, wherever it is in the log (here far from its end)
    reason, detail = classify(returncode=1, steps=OK_STEPS[:1], log=OOM_LOG)
    assert reason == "oom" and "Tried to allocate 18.50 GiB" in detail
    reason, detail = classify(returncode=-9, timed_out=True, steps=[], log=OOM_LOG)
    assert reason == "oom" and "hung" in detail
    for line in ("RuntimeError: Triton Error [CUDA]: out of memory",
                 "RuntimeError: CUDA driver error: out of memory",
                 "NCCL WARN Cuda failure 'out of memory'"):  # fmt: skip
        assert classify(returncode=1, steps=[], log="x\n" + line + "\ny") == ("oom", line)
    # a timeout without OOM text is a timeout, not an OOM
    reason, detail = classify(returncode=-15, timed_out=True, steps=OK_STEPS[:1], log="slow")
    assert reason == "timeout" and "600 s" in detail
    # anything else is an error, shown with the log's tail
    log = "error: unrecognized arguments: --relaymoe-fused-loss\n"
    reason, detail = classify(returncode=2, steps=[], log=log)
    assert reason == "error" and "unrecognized arguments" in detail
    # Triton's shared-memory "out of resource" is not a CUDA OOM
    log = "triton.runtime.errors.OutOfResources: out of resource: shared memory"
    assert classify(returncode=1, steps=[], log=log)[0] == "error"
    # trained, but Megatron's --spec import failed (default attention): not data
    reason, detail = classify(log="couldn't import module")
    assert reason == "error" and "--spec" in detail
    assert classify(log="", marker=None)[0] == "ok"  # TransformerEngine: no marker expected
    # a non-finite loss is an error, never an OOM
    nan = [OK_STEPS[0], {**OK_STEPS[1], "loss": float("nan")}]
    reason, detail = classify(steps=nan, log=ms.SDPA_MARKER + "\n" + OOM_LOG)
    assert reason == "error" and "non-finite" in detail
    # all steps trained, then a bad exit: the criterion (two steps) is met, the exit is noted
    reason, detail = classify(returncode=1)
    assert reason == "ok" and "exit status 1" in detail


def test_trial_from_log_reads_memory_and_the_oom_sizes():
    mem = ("[Rank 0] (after 1 iterations) memory (MB) | allocated: 30000.00 | max allocated: "
           "121000.50 | reserved: 125000.00 | max reserved: 126500.00\n")  # fmt: skip
    t = ms.trial_from_log(
        4096, returncode=1, timed_out=False, timeout_s=600.0, wall_s=95.0, steps=OK_STEPS[:1],
        log=mem + OOM_LOG, expected_steps=2, marker=ms.SDPA_MARKER, log_dir="/tmp/x",
    )  # fmt: skip
    assert t.reason == "oom" and not t.ok
    assert t.peak_MiB == 120_000.0 and t.step_s == (70.0,)
    assert t.megatron_max_allocated_MB == 121000.5 and t.megatron_max_reserved_MB == 126500.0
    assert t.oom_request_MiB == pytest.approx(18.5 * 1024)
    assert t.oom_allocated_MiB == pytest.approx(121.75 * 1024)
    d = t.to_dict()
    assert d["seq"] == 4096 and d["ok"] is False and d["reason"] == "oom"
    line = ms.trial_line(t)
    assert "OOM" in line and "121000 MB" in line and "/tmp/x/log.txt" in line
    with pytest.raises(ValueError, match="reason"):
        ms.Trial(1, "crashed", 0.0)


# -- launching ---------------------------------------------------------------------------------

_JOB = textwrap.dedent(
    """
    import os, subprocess, sys, time
    # like torchrun: a worker in its own session (outside the job's process group)
    w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
    open(os.path.join(os.getcwd(), "worker.pid"), "w").write(str(w.pid))
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", flush=True)
    time.sleep(float(sys.argv[1]))
    sys.exit(1)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sleep_s, timeout_s", [(0.5, 60.0), (60.0, 0.5)])
def test_launch_keeps_the_log_and_kills_leftover_workers(monkeypatch, tmp_path, sleep_s, timeout_s):
    """The job has started its worker before the launch's clock and its first look at the job's
    processes (the Popen stand-in waits for the worker's pid file), so the job ending at once
    or the timeout passing at once finds the worker either way."""

    def command(flags, *, gpus, report, capped=False):
        return [sys.executable, "-c", _JOB, str(sleep_s)]

    real_popen = ms.subprocess.Popen

    def popen(cmd, **kw):
        p = real_popen(cmd, **kw)
        if kw.get("cwd") is not None:  # the trial (a job run in its folder)
            pid_file = Path(kw["cwd"]) / "worker.pid"
            deadline = time.monotonic() + 60
            while not pid_file.exists() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return p

    monkeypatch.setattr(ms, "trial_command", command)
    monkeypatch.setattr(ms.subprocess, "Popen", popen)
    r = ms.launch([], gpus=2, timeout_s=timeout_s, workdir=tmp_path / "trial")
    assert r["timed_out"] == (timeout_s < sleep_s)
    assert "CUDA out of memory" in r["log"]
    assert (tmp_path / "trial" / "log.txt").exists() and (
        tmp_path / "trial" / "command.sh"
    ).exists()
    worker = int((tmp_path / "trial" / "worker.pid").read_text())
    for _ in range(50):  # SIGKILL is asynchronous
        if not _alive(worker):
            break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"worker {worker} outlived its job")
    assert "killed leftover processes" in r["log"]


def test_launch_passes_the_allocator_settings(monkeypatch, tmp_path):
    code = (
        "import os; print('CONF=' + os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '-'), "
        "'CAP=' + os.environ.get('RELAYMOE_MEMORY_CAP_BYTES', '-'))"
    )
    seen = {}
    assert ms.trial_command([], gpus=2, report="r", capped=True)[7] == ms.CAPPED_MODULE
    assert ms.trial_command([], gpus=2, report="r")[7] == "relaymoe.megatron.pretrain"

    def command(flags, *, gpus, report, capped=False):
        seen["capped"] = capped
        return [sys.executable, "-c", code]

    monkeypatch.setattr(ms, "trial_command", command)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    r = ms.launch([], gpus=2, timeout_s=60, workdir=tmp_path / "a", cap_bytes=123)
    assert "CONF=expandable_segments:True CAP=123" in r["log"] and seen["capped"]
    cmd = (tmp_path / "a" / "command.sh").read_text()
    assert cmd.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ")
    assert "RELAYMOE_MEMORY_CAP_BYTES=123 " in cmd
    r = ms.launch([], gpus=2, timeout_s=60, workdir=tmp_path / "b", alloc_conf="")
    assert "CONF=- CAP=-" in r["log"] and not seen["capped"]  # the allocator's default


def test_wait_gpus_free():
    assert ms.wait_gpus_free(2, probe=lambda: None) is None
    assert ms.wait_gpus_free(2, probe=lambda: [10.0, 300.0, 90_000.0]) is None  # GPU 2 unused
    why = ms.wait_gpus_free(2, wait_s=0.0, probe=lambda: [10.0, 90_000.0])
    assert "GPU 1: 90000 MiB" in why


# -- the time model ----------------------------------------------------------------------------


def test_time_model_grows_quadratically_and_calibrates_to_a_measurement():
    cfg = ms.planner_config(ms.DEFAULT_CONFIG, 2)
    tm = ms.TimeModel(cfg, steps=2)
    a, o = tm.step_flops(100_000)
    a2, o2 = tm.step_flops(200_000)
    assert a2 == pytest.approx(4 * a) and o2 == pytest.approx(2 * o)
    # attention core of one layer forward, by hand: 2 * s^2 * heads * head_dim
    assert a == pytest.approx(4 * 4.5 * 2 * 100_000**2 * 32 * 128)
    assert tm.trial_s(200_000) > tm.trial_s(100_000) > ms.STARTUP_S
    tm.calibrate(300_000, last_step_s=80.0, wall_s=250.0)
    assert tm.trial_s(300_000) == pytest.approx(250.0)
    assert tm.step_s(300_000) == pytest.approx(80.0) and tm.startup_s == pytest.approx(90.0)


# -- flags, dry run, a whole run ---------------------------------------------------------------


def _group(flags, name):
    i = flags.index(name)
    j = i + 1
    while j < len(flags) and not flags[j].startswith("--"):
        j += 1
    return flags[i + 1 : j]


H100 = 81_559 * 2**20  # the planner's h100-80gb


@pytest.mark.parametrize("policy", ms.POLICIES)
@pytest.mark.parametrize("provider", list(ms.PROVIDERS))
def test_trial_flags(provider, policy):
    p = ms.PROVIDERS[provider]
    f = ms.trial_flags(ms.DEFAULT_CONFIG, provider, 122_880, gpus=2, policy=policy,
                       gpu_bytes=H100, check_te=False)  # fmt: skip
    assert _group(f, "--seq-length") == ["122880"] and _group(f, "--micro-batch-size") == ["1"]
    assert _group(f, "--max-position-embeddings") == ["122880"]
    assert _group(f, "--expert-model-parallel-size") == ["2"]
    assert _group(f, "--global-batch-size") == ["2"] and _group(f, "--train-iters") == ["2"]
    assert _group(f, "--vocab-size") == ["151936"]
    assert _group(f, "--moe-token-dispatcher-type") == [p.dispatcher]
    assert ("--relaymoe-fused-loss" in f) == p.fused_loss
    assert "--no-create-attention-mask-in-dataloader" in f
    # megatron-core's fused cross-entropy where Megatron's loss runs under forced TE
    assert ("--cross-entropy-loss-fusion" in f) == p.ce_fusion
    if p.ce_fusion:
        assert _group(f, "--cross-entropy-fusion-impl") == ["native"]  # 0.19 refuses "te"
    if p.transformer_impl == ms.TE_IMPL:
        assert _group(f, "--transformer-impl") == ["transformer_engine"] and "--spec" not in f
    elif not ms.have_te():
        assert _group(f, "--spec") == ["benchmarks.sdpa_attention", "sdpa_decoder_spec"]
    # the policy's recompute flags, once each, at the end
    rc = {g[0]: g[1:] for g in ms.flag_groups(f) if g[0] in ms.RECOMPUTE_FLAGS}
    assert sum(w in ms.RECOMPUTE_FLAGS for w in f) == len(rc)
    if policy == "full":
        assert rc == {"--recompute-granularity": ["full"], "--recompute-method": ["uniform"],
                      "--recompute-num-layers": ["1"]}  # fmt: skip
    elif policy == "none":
        assert rc == {}
    elif p.dispatcher == "alltoall":
        assert rc == {
            "--recompute-granularity": ["selective"],
            "--recompute-modules": ["moe_act", "layernorm", "core_attn", "moe"],
        }
    else:  # the ring: the plan `relaymoe plan` prints for that GPU at that length (block),
        # or full recompute where the plan itself does not fit (uniform)
        assert rc == {} or rc["--recompute-granularity"] == ["full"], rc
        assert rc.get("--recompute-method", ["block"]) in (["block"], ["uniform"])
        assert f[len(f) - sum(len(v) + 1 for v in rc.values()) :] == [
            w for k, v in rc.items() for w in (k, *v)
        ]


def test_the_rings_selective_policy_is_the_plan_for_the_gpu_at_that_length():
    """Short sequences keep layers, long ones recompute them: the planner's own flags (the
    plan's ``planned_recompute_flags``), and full recompute where even that does not fit."""
    from relaymoe.planner import plan
    from relaymoe.planner.plan import policy_max_seq, usable_bytes

    def flags(seq, provider="relaymoe_ring_te_fused_loss", gpus=1):
        f = ms.trial_flags(ms.DEFAULT_CONFIG, provider, seq, gpus=gpus, policy="selective",
                           gpu_bytes=H100, check_te=False)  # fmt: skip
        return [w for g in ms.flag_groups(f) if g[0] in ms.RECOMPUTE_FLAGS for w in g]

    cfg = ms.planner_config(ms.DEFAULT_CONFIG, 1, "relaymoe_ring_te_fused_loss").replace(
        training={"seq_length": 98304}, relaymoe={"fused_loss": True}
    )
    want = list(plan(cfg, H100).planned_recompute_flags)
    assert flags(98304) == want and want[:4] == ["--recompute-granularity", "full",
                                                 "--recompute-method", "block"]  # fmt: skip
    assert 0 < int(want[-1]) < 4  # some layers kept, some recomputed
    assert flags(65536) == []  # everything kept
    longest = policy_max_seq(cfg, "ring", "full", usable_bytes(H100), fused_loss=True)
    assert longest > 98304 and flags(longest)[-1] == "4"  # the longest: all recomputed
    assert flags(400_000) == ms.policy_flags("full", "ring")  # beyond: the plan refuses
    with pytest.raises(ValueError, match="give its memory"):
        ms.trial_flags(ms.DEFAULT_CONFIG, "relaymoe_ring_te", 8192, gpus=1, policy="selective",
                       check_te=False)  # fmt: skip


def test_dry_run_prints_predictions_and_plan_and_launches_nothing(monkeypatch, tmp_path, capsys):
    def boom(*a, **k):
        raise AssertionError("the dry run launched something")

    monkeypatch.setattr(ms, "launch", boom)
    monkeypatch.setattr(ms, "device_facts", boom)
    out = tmp_path / "rows.jsonl"
    assert ms.main(["--dry-run", "--gpu-bytes", "150GB", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    jobs = ms.jobs_of(ms.DEFAULT_PROVIDERS, ["full"])
    pred = ms.predict(ms.DEFAULT_CONFIG, 2, 150 * 10**9, jobs)
    for job in jobs:
        first = ms.first_trial(pred.max_seq[job], 32768)
        assert f"== {job.name}: planner predicts {pred.max_seq[job]} " in text
        assert f"first trial {first} (est " in text
        assert f"--seq-length {first} " in text
    assert "--relaymoe-fused-loss" in text and "--no-create-attention-mask-in-dataloader" in text
    assert "--relaymoe-memory-phases" in text
    assert "usable" in text and not out.exists()


def test_main_rejects_bad_arguments(capsys):
    for argv in (["--providers", "mcore_alltoall,bogus"], ["--steps", "1"],
                 ["--gpu-bytes", "lots"], ["--limit-seq", "100"], ["--growth", "0"],
                 ["--memory-cap", "h100-80gb", "--gpu-bytes", "80GB"],
                 ["--memory-cap", "tiny"], ["--policies", "full,some"],
                 ["--lanes", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            ms.main(["--dry-run", *argv])
    assert "bogus" in capsys.readouterr().err


def job_result(ok: bool, workdir, *, steps, log: str, wall_s: float = 120.0) -> dict:
    """What ``launch`` returns for a fake trial."""
    return {"returncode": 0 if ok else 1, "timed_out": False, "wall_s": wall_s, "steps": steps,
            "log": log, "command": "torchrun ...", "log_dir": str(workdir)}  # fmt: skip


def fake_machine(monkeypatch, launch, *, gpu="FAKE H200", count=2, total=150 * 10**9):
    """``launch`` in place of the GPU jobs, on ``count`` GPUs of ``total`` bytes, all free."""
    facts = {"count": count, "gpu": gpu, "free_bytes": total - 10**9, "total_bytes": total}
    monkeypatch.setattr(ms, "launch", launch)
    monkeypatch.setattr(ms, "device_facts", lambda n: facts)
    monkeypatch.setattr(ms, "wait_gpus_free", lambda gpus, **kw: None)


def test_a_whole_run_writes_one_row_per_provider(monkeypatch, tmp_path):
    """Everything but the GPU jobs: planner, search, classification and rows."""
    truth = {
        "mcore_alltoall": 100_000,
        "relaymoe_ring": 110_000,
        "relaymoe_ring_fused_loss": 250_000,
    }
    launched = []

    def fake_launch(flags, *, gpus, timeout_s, workdir, alloc_conf, cap_bytes, **kw):
        assert alloc_conf == ms.ALLOC_CONF and cap_bytes is None and kw["devices"] is None
        seq = int(_group(flags, "--seq-length")[0])
        fused = "--relaymoe-fused-loss" in flags
        disp = _group(flags, "--moe-token-dispatcher-type")[0]
        name = {("alltoall", False): "mcore_alltoall", ("ring", False): "relaymoe_ring",
                ("ring", True): "relaymoe_ring_fused_loss"}[(disp, fused)]  # fmt: skip
        launched.append((name, seq))
        ok = seq <= truth[name]
        steps = OK_STEPS if ok else OK_STEPS[:1]
        log = ms.SDPA_MARKER + "\n" + ("" if ok else OOM_LOG)
        return job_result(ok, workdir, steps=steps, log=log)

    fake_machine(monkeypatch, fake_launch)
    out = tmp_path / "rows.jsonl"
    rc = ms.main(["--out", str(out), "--workdir", str(tmp_path / "w"), "--budget-s", "1e9"])
    assert rc == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["provider"] for r in rows] == list(ms.DEFAULT_PROVIDERS)
    jobs = ms.jobs_of(ms.DEFAULT_PROVIDERS, ["full"])
    pred = ms.predict(ms.DEFAULT_CONFIG, 2, 150 * 10**9, jobs)
    for r, job in zip(rows, jobs, strict=True):
        want = truth[r["provider"]] // STEP * STEP
        assert r["bench"] == "max_seq" and r["gpu"] == "FAKE H200" and r["commit"]
        assert r["max_seq"] == want and r["first_oom_seq"] == want + STEP
        assert r["bracket_open"] is False and r["stop_reason"] == "converged"
        assert r["predicted_max_seq"] == pred.max_seq[job] and r["recompute_policy"] == "full"
        assert r["planner_gpu_bytes"] == 150 * 10**9 and r["gpu_total_bytes"] == 150 * 10**9
        assert r["peak_MiB_at_max_seq"] == 121_000.5 and r["planner_peak_at_max_seq_MiB"] > 0
        assert r["trials"][0]["seq"] == ms.first_trial(r["predicted_max_seq"], 32768)
        for t in r["trials"]:
            assert {"seq", "ok", "reason", "wall_s", "peak_MiB"} <= set(t)
        second = r["anchor_seq_note"] == "a second, timed trial"  # at the anchor's length
        assert r["n_trials"] + second == len([x for x in launched if x[0] == r["provider"]])
        assert r["anchor"] == "mcore_alltoall" and r["anchor_max_seq"] == 98304
        if r["provider"] == "mcore_alltoall":
            assert r["anchor_seq_note"] == "the anchor itself" and not second
        else:  # each trains the anchor's length: timed there (once more, or by its search)
            assert r["anchor_seq_trial"]["seq"] == 98304 and r["anchor_seq_trial"]["ok"]
            assert second or r["anchor_seq_note"] == "a trial of the search at that length"
            assert r["tokens_per_s_at_anchor_seq"] is None  # the fake report has none
        assert r["alloc_conf"] == ms.ALLOC_CONF and r["memory_cap_bytes"] is None


@pytest.mark.parametrize("cap_marker", [True, False])
def test_a_capped_run_plans_for_the_smaller_gpu_and_needs_the_cap_marker(
    monkeypatch, tmp_path, cap_marker
):
    from benchmarks.capped_pretrain import MARKER
    from relaymoe.planner.plan import parse_gpu

    (job,) = ms.jobs_of(["relaymoe_ring_fused_loss"], ["full"])
    small = ms.predict(ms.DEFAULT_CONFIG, 2, parse_gpu("h100-80gb"), [job])
    truth = small.max_seq[job] // STEP * STEP
    caps = []

    def fake_launch(flags, *, gpus, timeout_s, workdir, alloc_conf, cap_bytes, **kw):
        caps.append(cap_bytes)
        ok = int(_group(flags, "--seq-length")[0]) <= truth
        log = ms.SDPA_MARKER + "\n" + (MARKER + "\n" if cap_marker else "")
        return job_result(ok, workdir, steps=OK_STEPS if ok else OK_STEPS[:1],
                          log=log + ("" if ok else OOM_LOG), wall_s=10.0)  # fmt: skip

    fake_machine(monkeypatch, fake_launch)
    out = tmp_path / "rows.jsonl"
    argv = ["--out", str(out), "--workdir", str(tmp_path / "w"), "--memory-cap", "h100-80gb",
            "--providers", "relaymoe_ring_fused_loss", "--growth", "0.03"]  # fmt: skip
    rc = ms.main(argv)
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert set(caps) == {small.usable_bytes} and row["memory_cap_bytes"] == small.usable_bytes
    assert row["memory_cap_gpu"] == "h100-80gb" and row["planner_gpu_bytes"] == small.gpu_bytes
    assert row["predicted_max_seq"] == small.max_seq[job]
    if cap_marker:
        assert rc == 0 and row["max_seq"] == truth and row["stop_reason"] == "converged"
        # the prediction (it fits), one move up by the growth (it fails), then bisections
        # down to the prediction, each one failing
        lo = truth // STEP
        hi, bisections = max(lo + 1, math.ceil(lo * 1.03)), 0
        while hi - lo > 1:
            hi, bisections = (lo + hi) // 2, bisections + 1
        assert row["n_trials"] == 2 + bisections
    else:  # the cap never took effect: an error, not a measurement
        assert rc == 1 and row["stop_reason"] == "error" and MARKER in row["error"]


# -- the SDPA core attention -------------------------------------------------------------------


def _attention(heads, groups, d, *, softmax_scale=None, **cfg_kw):
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks import sdpa_attention as sa  # Megatron's attention: imported when used

    mask_type = cfg_kw.pop("mask_type", AttnMaskType.causal)
    cfg_kw.setdefault("attention_dropout", 0.0)
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                            num_query_groups=groups, kv_channels=d, **cfg_kw)  # fmt: skip
    tp = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return sa.SdpaCoreAttention(
        cfg, 1, mask_type, "self", softmax_scale=softmax_scale, pg_collection=tp
    )


def attention_reference(q_SBNd, k_SBGd, v_SBGd, scale=None):
    """float64 causal attention, head n reading group n // (N/G) (Megatron's GQA)."""
    q, k, v = (t.double() for t in (q_SBNd, k_SBGd, v_SBGd))
    s, b, n, d = q.shape
    rep = n // k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.empty(s, b, n, d, dtype=torch.float64)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    for h in range(n):
        sc = torch.einsum("sbd,tbd->bst", q[:, :, h], k[:, :, h // rep]) * scale
        p = sc.masked_fill(causal, float("-inf")).softmax(-1)
        out[:, :, h] = torch.einsum("bst,tbd->sbd", p, v[:, :, h // rep])
    return out.reshape(s, b, n * d)


def rel(a, b, floor: float = 1e-300):
    """||a - b|| / max(||b||, floor); ``floor`` is the scale an exact zero is judged against (a
    one-token sequence has dq = dk = 0 exactly, which fp32 meets only to its rounding)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(floor))


@pytest.mark.parametrize(
    "s, b, heads, groups, d, scale",
    [(7, 3, 6, 2, 16, None), (13, 1, 4, 4, 24, None), (1, 2, 8, 1, 8, None),
     (33, 2, 9, 3, 32, 0.3)],
)  # fmt: skip
def test_sdpa_attention_matches_the_float64_oracle(s, b, heads, groups, d, scale):
    g = torch.Generator().manual_seed(s * 100 + heads)
    att = _attention(heads, groups, d, softmax_scale=scale)
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    k = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    v = torch.randn(s, b, groups, d, generator=g, requires_grad=True)
    out = att(q, k, v, None)
    assert out.shape == (s, b, heads * d) and out.dtype == torch.float32
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(qr, kr, vr, scale)
    assert rel(out, ref) < 1e-5
    dy = torch.randn(s, b, heads * d, generator=g)
    out.backward(dy)
    ref.backward(dy.double())
    for x, xr in ((q, qr), (k, kr), (v, vr)):
        # against the gradient's own norm, or the incoming one's where the exact one is 0
        floor = float(dy.norm()) if float(xr.grad.norm()) == 0.0 else 1e-300
        assert rel(x.grad, xr.grad, floor=floor) < 1e-5, (s, float(x.grad.norm()))


def test_sdpa_attention_refusals():
    from megatron.core.transformer.enums import AttnMaskType

    att = _attention(4, 2, 8)
    q, kv = torch.randn(5, 1, 4, 8), torch.randn(5, 1, 2, 8)
    with pytest.raises(ValueError, match="no-create-attention-mask-in-dataloader"):
        att(q, kv, kv, torch.zeros(1, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal"):
        att(q, kv, kv, None, attn_mask_type=AttnMaskType.padding)
    with pytest.raises(ValueError, match="packed"):
        att(q, kv, kv, None, packed_seq_params=object())
    with pytest.raises(ValueError, match="groups"):
        att(q, torch.randn(5, 1, 4, 8), torch.randn(5, 1, 4, 8), None)
    with pytest.raises(ValueError, match="dropout"):
        _attention(4, 2, 8, attention_dropout=0.1)
    with pytest.raises(ValueError, match="attn_mask_type"):
        _attention(4, 2, 8, mask_type=AttnMaskType.padding)


def test_substitute_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from benchmarks import sdpa_attention as sa

    layer = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True)
    block = TransformerBlockSubmodules(layer_specs=[layer, layer, layer])
    new, n = sa.substitute_core_attention(block)
    assert n == 3
    assert all(
        ls.submodules.self_attention.submodules.core_attention is sa.SdpaCoreAttention
        for ls in new.layer_specs
    )
    # a copy: Megatron's own spec is left as it was
    assert layer.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert sa.substitute_core_attention(layer)[1] == 1
    assert sa.substitute_core_attention(new)[1] == 3  # idempotent

    class OtherAttention:
        pass

    other, _ = sa.substitute_core_attention(layer)
    other.submodules.self_attention.submodules.core_attention = OtherAttention
    with pytest.raises(ValueError, match="OtherAttention"):
        sa.substitute_core_attention(other)
    with pytest.raises(ValueError, match="no self-attention"):
        sa.substitute_core_attention(TransformerBlockSubmodules(layer_specs=[]))


# -- Megatron: the harness's flags build a GPT whose attention is SDPA and matches the local one

_BUILD = MEGATRON_CPU_PRELUDE + textwrap.dedent(
    """
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import set_args
    from megatron.training.models.gpt import GPTModelBuilder
    from benchmarks.max_seq import trial_flags
    from benchmarks.sdpa_attention import SdpaCoreAttention
    S = 48
    # fp32 (not the trials' bf16) so that the two attentions can be compared tightly; no
    # recompute (its checkpoints save the CUDA generator's state, which a CPU has not)
    flags = trial_flags("tiny_qwen3", "relaymoe_ring", S, gpus=1, policy="none")
    flags = [f for f in flags if f != "--bf16"]
    sys.argv = ["pretrain", *flags, "--use-cpu-initialization"]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    args.gradient_accumulation_fusion = False  # no DDP here: the gradients compared are .grad
    assert not args.create_attention_mask_in_dataloader
    set_args(args)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    models = {}
    for name, spec in (("sdpa", args.spec), ("local", None)):
        args.spec = spec
        torch.manual_seed(0)
        models[name] = GPTModelBuilder(gpt_config_from_args(args)).build_model(pgs)
    models["local"].load_state_dict(models["sdpa"].state_dict())
    for name, kind in (("sdpa", SdpaCoreAttention), ("local", DotProductAttention)):
        cores = [type(m.core_attention) for m in models[name].modules()
                 if isinstance(m, SelfAttention)]
        assert cores == [kind] * args.num_layers, (name, cores)
        for m in models[name].modules():  # the router needs CUDA: MoE passes its input through
            if isinstance(m, MoELayer):
                m.forward = lambda h, *a, **k: (h, None)
    import contextlib
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.padded_vocab_size, (2, S), generator=g)
    pos = torch.arange(S).unsqueeze(0).expand(2, S)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)  # True: masked
    out = {}
    for name, mask in (("sdpa", None), ("local", causal)):
        m = models[name]
        loss = m(tokens, pos, mask, labels=tokens)
        loss.float().mean().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        out[name] = (loss.detach(), grads)
    (la, ga), (lb, gb) = out["sdpa"], out["local"]
    rel = lambda a, b: float((a - b).double().norm() / b.double().norm())
    assert set(ga) == set(gb) and len(ga) > 10, (len(ga), len(gb))
    worst = max(rel(ga[n], gb[n]) for n in ga if gb[n].norm() > 0)
    print("LOSS_REL", rel(la, lb), "GRAD_REL", worst)
    assert rel(la, lb) < 1e-5 and worst < 1e-5, (rel(la, lb), worst)
    print("MATCH")
    """
)


def test_harness_flags_build_a_gpt_with_sdpa_attention_matching_megatrons_local_one():
    from benchmarks import sdpa_attention as sa

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    p = run_python(["-c", _BUILD], timeout=240, env=env, cwd=ROOT)
    assert p.returncode == 0 and "MATCH" in p.stdout, p.stdout[-3000:] + p.stderr[-5000:]
    assert sa.MARKER in p.stdout and ms.SDPA_MARKER == sa.MARKER


# -- issue #53: TE providers x recompute policies, lanes, anchors, the measured breakdown --------

GiB = 2**30


def phases_for(seq: int) -> dict:
    """A step's memory phases (``relaymoe.megatron.memory_phases.breakdown``) as a fake report
    line carries them: 52 GiB of states, 30 KiB a token kept, a backward peak of 100 KiB a
    token over it."""
    from relaymoe.megatron.memory_phases import MARKS, breakdown

    s, kept, ws = 52 * GiB, 30 * 1024 * seq, 100 * 1024 * seq
    pairs = [(s, s), (s + kept, s + kept), (s + kept, s + kept + 1), (s, s + kept + ws),
             (s, s + kept + ws)]  # fmt: skip
    return breakdown(dict(zip(MARKS, pairs, strict=True)))


def te_truth(provider: str, policy: str) -> int:
    """The fake GPU's longest sequence of each job."""
    base = {"mcore_alltoall_te": 24_000, "mcore_alltoall_te_fused_loss": 90_000,
            "relaymoe_ring_te": 25_000,
            "relaymoe_ring_te_fused_loss": 130_000}[provider]  # fmt: skip
    return int(base * {"full": 1.0, "selective": 0.8, "none": 0.5}[policy])


def test_a_te_run_of_every_policy_on_two_lanes(monkeypatch, tmp_path):
    """The four TE providers x three policies on two one-GPU lanes: each job on one lane at a
    time, the anchors' searches first, each other job timed once more at its anchor's longest
    sequence, and rows with the policy, the exact flags, TE, the peak, tokens/s at both lengths,
    the measured breakdown beside the planner's and the binding terms."""
    import threading

    from benchmarks import e2e

    monkeypatch.setattr(ms, "have_te", lambda: True)
    monkeypatch.setattr(e2e, "have_te", lambda: True)
    busy, lock, order = {}, threading.Lock(), []

    def fake_launch(flags, *, gpus, timeout_s, workdir, alloc_conf, cap_bytes, devices, cancel):
        seq = int(_group(flags, "--seq-length")[0])
        job = workdir.parent.name  # <provider>_<policy>
        provider, policy = job.rsplit("_", 1)
        with lock:  # one trial a lane at a time, never two lanes on one GPU
            assert devices not in busy.values() and gpus == 1 and cap_bytes is not None
            busy[job] = devices
            order.append((provider, policy, seq, workdir.name))
        assert _group(flags, "--transformer-impl") == ["transformer_engine"]
        assert "--spec" not in flags and not cancel.is_set()
        time.sleep(0.01)
        ok = seq <= te_truth(provider, policy)
        steps = [{**s, "tokens_per_s": 1e6 / seq, "memory_phases": phases_for(seq)}
                 for s in (OK_STEPS if ok else OK_STEPS[:1])]  # fmt: skip
        with lock:
            del busy[job]
        return job_result(ok, workdir, steps=steps, log=("" if ok else OOM_LOG) + CAP_LOG,
                          wall_s=60.0)  # fmt: skip

    fake_machine(monkeypatch, fake_launch, gpu="FAKE H100", total=85 * 10**9)
    out = tmp_path / "rows.jsonl"
    argv = ["--out", str(out), "--workdir", str(tmp_path / "w"), "--providers",
            ",".join(ms.TE_PROVIDERS), "--policies", "full,selective,none", "--gpus", "1",
            "--lanes", "all", "--memory-cap", "h100-80gb", "--growth", "0.03"]  # fmt: skip
    assert ms.main(argv) == 0
    rows = {(r["provider"], r["recompute_policy"]): r
            for r in map(json.loads, out.read_text().splitlines())}  # fmt: skip
    assert len(rows) == 12
    # the three anchors' searches start first, on the two lanes
    firsts = [(p, pol) for p, pol, _, _ in order]
    assert {firsts[0], firsts[1]} <= {(ms.ANCHOR_TE, pol) for pol in ms.POLICIES}
    for (provider, policy), r in rows.items():
        want = te_truth(provider, policy) // STEP * STEP
        anchor = rows[(ms.ANCHOR_TE, policy)]
        assert r["max_seq"] == want and r["stop_reason"] == "converged", r["trials"]
        assert (
            r["transformer_impl"] == "transformer_engine"
            and r["attention"] == r["transformer_impl"]
        )
        assert r["flags"] == ms.trial_flags(ms.DEFAULT_CONFIG, provider, want, gpus=1,
                                            policy=policy, gpu_bytes=H100)  # fmt: skip
        assert r["peak_MiB_at_max_seq"] == 121_000.5
        assert r["tokens_per_s_at_max_seq"] == pytest.approx(1e6 / want)
        assert r["anchor"] == ms.ANCHOR_TE and r["anchor_max_seq"] == anchor["max_seq"]
        assert r["tokens_per_s_at_anchor_seq"] == pytest.approx(1e6 / anchor["max_seq"])
        if provider != ms.ANCHOR_TE:  # a second run at the anchor's length, after its search
            n = anchor["max_seq"]
            assert r["anchor_seq_trial"]["seq"] == n
            again = (provider, policy, n, f"anchor_s{n}") in order
            reused = any(t["seq"] == n and t["ok"] for t in r["trials"])
            assert again != reused, (again, reused)  # one or the other, never both
        # the measured breakdown at the longest sequence beside the planner's, same names
        m, pl = r["measured_breakdown"], r["planner_breakdown_at_max_seq"]
        assert m == phases_for(want) and r["binding_term"] == "layer_working_set"
        assert m["terms"]["activations_retained"] == 30 * 1024 * want
        assert set(pl["terms"]) >= set(m["terms"]) - {"optimizer_step"}
        assert pl["seq"] == want and r["planner_binding_term"] == pl["binding_term"]
        assert r["planner_peak_at_max_seq_MiB"] == pytest.approx(pl["total"] / 2**20)
        (at_max,) = [t for t in r["trials"] if t["ok"] and t["seq"] == want]
        assert r["recompute"] == " ".join(at_max["recompute"])
        n = len(at_max["recompute"])
        assert r["flags"][len(r["flags"]) - n :] == at_max["recompute"]  # the flags' last ones
    # the planner: full recompute binds on the working set, no recompute on what layers keep
    assert rows[("relaymoe_ring_te_fused_loss", "full")]["planner_binding_term"] == (
        "layer_working_set"
    )
    assert rows[("mcore_alltoall_te_fused_loss", "none")]["planner_binding_term"] == (
        "activations_retained"
    )
    assert rows[("mcore_alltoall_te", "full")]["planner_binding_term"] == "logits_loss"


CAP_LOG = "\n[capped_pretrain] allocator capped at 1 of 2 bytes on cuda:0\n"


def test_an_anchor_from_earlier_rows(monkeypatch, tmp_path):
    """A provider whose anchor is not run here is timed at the anchor's length from
    ``--anchor-rows`` (same policy, config, GPUs and cap); without them, the row says so."""
    from benchmarks import e2e

    monkeypatch.setattr(ms, "have_te", lambda: True)
    monkeypatch.setattr(e2e, "have_te", lambda: True)
    seqs = []

    def fake_launch(flags, *, workdir, **kw):
        seq = int(_group(flags, "--seq-length")[0])
        seqs.append((workdir.name, seq))
        ok = seq <= 60_000
        steps = [{**s, "tokens_per_s": 7.0} for s in OK_STEPS] if ok else []
        return job_result(ok, workdir, steps=steps, log=("" if ok else OOM_LOG) + CAP_LOG)

    fake_machine(monkeypatch, fake_launch, gpu="FAKE H100", count=1, total=85 * 10**9)
    earlier = tmp_path / "earlier.jsonl"
    base = {"bench": "max_seq", "config": ms.DEFAULT_CONFIG, "gpus": 1,
            "memory_cap_gpu": "h100-80gb", "provider": ms.ANCHOR_TE}  # fmt: skip
    earlier.write_text("\n".join(json.dumps({**base, **kw}) for kw in (
        {"recompute_policy": "none", "max_seq": 12288},
        {"recompute_policy": "full", "max_seq": 24576},
        {"recompute_policy": "full", "max_seq": 20480, "gpus": 2},
    )) + "\n")  # fmt: skip
    argv = ["--providers", "mcore_alltoall_te_fused_loss", "--gpus", "1", "--memory-cap",
            "h100-80gb", "--workdir", str(tmp_path / "w"), "--start-seq", "57344"]  # fmt: skip
    assert ms.main([*argv, "--anchor-rows", str(earlier), "--out", str(tmp_path / "a")]) == 0
    (r,) = map(json.loads, (tmp_path / "a").read_text().splitlines())
    assert r["anchor_max_seq"] == 24576 and ("anchor_s24576", 24576) in seqs
    assert r["tokens_per_s_at_anchor_seq"] == 7.0 and r["max_seq"] == 57344
    assert ms.main([*argv, "--out", str(tmp_path / "b")]) == 0
    (r,) = map(json.loads, (tmp_path / "b").read_text().splitlines())
    assert r["anchor_max_seq"] is None and "--anchor-rows" in r["anchor_seq_note"]
    assert r["tokens_per_s_at_anchor_seq"] is None
    # a search that stopped on an error is not timed at the anchor's length either
    calls = []

    def broken(flags, *, workdir, **kw):
        calls.append(workdir.name)
        return job_result(False, workdir, steps=[], log="error: unrecognized arguments: --x")

    monkeypatch.setattr(ms, "launch", broken)
    assert ms.main([*argv, "--anchor-rows", str(earlier), "--out", str(tmp_path / "c")]) == 1
    (r,) = map(json.loads, (tmp_path / "c").read_text().splitlines())
    assert r["stop_reason"] == "error" and r["anchor_seq_note"].endswith("on an error")
    assert r["anchor_seq_trial"] is None and calls == ["s57344"]


def test_lane_queue_runs_tasks_in_order_on_free_lanes_and_reraises():
    import threading

    from benchmarks.lanes import LaneQueue, lane_devices

    assert lane_devices(3, 2) == [(0, 1), (2, 3), (4, 5)]
    with pytest.raises(ValueError, match="lanes=0"):
        lane_devices(0, 1)
    q, seen, lock = LaneQueue(lane_devices(2, 1)), [], threading.Lock()
    gate = threading.Barrier(2, timeout=10)

    def task(name, then=None):
        def run(lane):
            if name in ("a", "b"):
                gate.wait()  # a and b run at once, one on each lane
            with lock:
                seen.append((name, lane))
            if then:
                q.put(then)
            if name == "boom":
                raise RuntimeError("boom")

        return run

    q.put(task("a", then=task("c")))
    q.put(task("b"))
    q.put(task("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        q.run()
    assert {n for n, _ in seen} == {"a", "b", "c", "boom"}
    assert {lane for n, lane in seen if n in "ab"} == {(0,), (1,)}
    one = LaneQueue([(0,)])
    one.put(lambda lane: seen.append(("inline", threading.current_thread())))
    one.run()
    assert seen[-1] == ("inline", threading.main_thread())


def test_launch_pins_the_lanes_gpus(monkeypatch, tmp_path):
    code = "import os; print('CVD=' + os.environ.get('CUDA_VISIBLE_DEVICES', '-'))"
    monkeypatch.setattr(ms, "trial_command", lambda flags, **kw: [sys.executable, "-c", code])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = ms.launch([], gpus=1, timeout_s=60, workdir=tmp_path / "a", devices=(3,))
    assert "CVD=3" in r["log"] and "CUDA_VISIBLE_DEVICES=3 " in r["command"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")  # the lanes index what we see
    r = ms.launch([], gpus=2, timeout_s=60, workdir=tmp_path / "b", devices=(1, 2))
    assert "CVD=6,7" in r["log"]
    with pytest.raises(ValueError, match="only 3 visible"):
        ms.visible_devices((3,), {"CUDA_VISIBLE_DEVICES": "4,6,7"})
    assert ms.wait_gpus_free(1, devices=(1,), probe=lambda: [90_000.0, 10.0]) is None
    assert "GPU 0" in ms.wait_gpus_free(1, devices=(0,), wait_s=0, probe=lambda: [9e4, 1.0])


_PARSE_TE = MEGATRON_CPU_PRELUDE + textwrap.dedent(
    """
    import contextlib, io, json, traceback
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables
    KEYS = ("transformer_impl", "recompute_granularity", "recompute_method",
            "recompute_num_layers", "recompute_modules", "fine_grained_activation_offloading",
            "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "moe_token_dispatcher_type")
    env = dict(os.environ)
    for i, flags in enumerate(json.loads(sys.stdin.read())):
        sys.argv, err = ["pretrain", *flags], io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                a = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
                c = gpt_config_from_args(a)  # TransformerConfig.__post_init__'s checks
            print("ARGS " + json.dumps([i, {k: getattr(c, k, getattr(a, k, None))
                                            for k in KEYS}]), flush=True)
        except BaseException:
            print("ERROR " + json.dumps([i, err.getvalue() + traceback.format_exc()]), flush=True)
        finally:
            unset_global_variables()
            os.environ.clear()
            os.environ.update(env)
    """
)


def test_megatron_accepts_each_te_provider_and_policys_flags_and_refuses_the_offloading():
    """Megatron's own parser and ``TransformerConfig`` take every TE provider's flags under
    every policy at EP 1 (with ``--no-rope-fusion`` added: TE's fused RoPE, which this CPU
    lacks, is the only TE piece that validation asks for, after the recompute checks); the
    offloading the issue names is refused beside ``--recompute-modules ... moe`` by
    megatron-core 0.19, which is why the selective policy passes none."""
    from relaymoe.planner.policies import MCORE_OFFLOAD_MODULES

    jobs = [(p, pol) for p in ms.TE_PROVIDERS for pol in ms.POLICIES]
    # lengths near each one's longest on an H100, where the ring's plan recomputes by blocks
    seq = lambda p: 98304 if ms.PROVIDERS[p].fused_loss else 24576  # noqa: E731
    flagsets = [ms.trial_flags(ms.DEFAULT_CONFIG, p, seq(p), gpus=1, policy=pol,
                               gpu_bytes=H100, check_te=False) + ["--no-rope-fusion"]
                for p, pol in jobs]  # fmt: skip
    offload = ["--fine-grained-activation-offloading", "--offload-modules", "expert_fc1",
               "moe_act"]  # fmt: skip
    flagsets.append(flagsets[jobs.index((ms.ANCHOR_TE, "selective"))] + offload)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    p = run_python(["-c", _PARSE_TE], timeout=240, env=env, cwd=ROOT, input=json.dumps(flagsets))
    got = {}
    for ln in p.stdout.splitlines():
        if ln.startswith(("ARGS ", "ERROR ")):
            i, v = json.loads(ln.split(" ", 1)[1])
            got[i] = v if ln.startswith("ARGS ") else "refused: " + v
    assert len(got) == len(flagsets), p.stdout[-2000:] + p.stderr[-4000:]
    for i, (provider, policy) in enumerate(jobs):
        a, prov = got[i], ms.PROVIDERS[provider]
        assert isinstance(a, dict), (provider, policy, a)
        assert a["transformer_impl"] == "transformer_engine"
        assert a["moe_token_dispatcher_type"] == prov.dispatcher
        assert a["cross_entropy_loss_fusion"] == prov.ce_fusion
        assert not a["fine_grained_activation_offloading"]
        if policy == "full":
            assert (a["recompute_granularity"], a["recompute_method"],
                    a["recompute_num_layers"]) == ("full", "uniform", 1)  # fmt: skip
        elif policy == "none":
            assert a["recompute_granularity"] is None
        elif prov.dispatcher == "alltoall":
            assert a["recompute_granularity"] == "selective"
            assert a["recompute_modules"] == ["moe_act", "layernorm", "core_attn", "moe"]
        else:  # the ring's plan for an H100 at that length: recompute the first N by blocks
            assert (a["recompute_granularity"], a["recompute_method"]) == ("full", "block")
            assert 0 < a["recompute_num_layers"] <= 4
    refused = got[len(jobs)]
    assert MCORE_OFFLOAD_MODULES == ()
    assert isinstance(refused, str) and "while recomputing the entire MoE layer" in refused
