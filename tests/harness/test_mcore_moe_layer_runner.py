"""benchmarks/mcore_moe_layer_tests.py without a GPU or Megatron's tests: the ring rows its plugin
adds to dispatcher parametrizations, refusals read as skips, and the verdict against the
alltoall twins (on a stand-in test file written here; the real run is
tests/gpu/test_mcore_moe_layer_gpu.py)."""

from __future__ import annotations

import pytest

from benchmarks import mcore_moe_layer_tests as runner

REFUSAL = (
    "--moe-token-dispatcher-type ring cannot run this configuration:\\n"
    "  - expert tensor parallelism is not supported with the ring dispatcher; fix: pass "
    "--expert-tensor-parallel-size 1"
)

STAND_IN = f'''
import pytest


@pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
@pytest.mark.parametrize("tp", [1, 2])
def test_layer(moe_token_dispatcher_type, tp):
    if moe_token_dispatcher_type == "ring" and tp == 2:
        raise ValueError("{REFUSAL}")
    assert BROKEN is None or moe_token_dispatcher_type != "ring" or tp != 1, BROKEN


class TestPairs:
    @pytest.mark.parametrize("moe_token_dispatcher_type,n", [("alltoall", 1), ("allgather", 2)])
    def test_pairs(self, moe_token_dispatcher_type, n):
        assert n == 1 or moe_token_dispatcher_type == "allgather"


@pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather"])
def test_no_alltoall_no_ring(moe_token_dispatcher_type):
    assert moe_token_dispatcher_type == "allgather"


@pytest.mark.parametrize("moe_token_dispatcher_type", ["alltoall"])
def test_fails_everywhere(moe_token_dispatcher_type):
    raise RuntimeError("world too small")
'''


def test_ring_rows_join_the_alltoall_ones():
    assert runner.with_ring("moe_token_dispatcher_type", ["allgather", "alltoall"]) == [
        "allgather", "alltoall", "ring"]  # fmt: skip
    assert runner.with_ring("moe_token_dispatcher_type", ["allgather"]) is None
    assert runner.with_ring("moe_token_dispatcher_type", ["alltoall", "ring"]) is None
    assert runner.with_ring("x", [1, 2]) is None
    assert runner.with_ring(("n", "moe_token_dispatcher_type"), [(1, "alltoall"), (2, "flex")]) == [
        (1, "alltoall"), (2, "flex"), (1, "ring")]  # fmt: skip
    param = pytest.param("alltoall", id="a2a")
    assert runner.with_ring("moe_token_dispatcher_type", [param])[-1] == "ring"


def _run(tmp_path, broken=None):
    path = tmp_path / f"test_standin_{'broken' if broken else 'ok'}.py"
    path.write_text(f"BROKEN = {broken!r}\n" + STAND_IN)
    rc, plugin = runner.run_pytest(path, tmp_path, register=False)
    return rc, runner.verdict(plugin.results)


def test_refusals_skip_and_the_verdict_judges_ring_against_alltoall(tmp_path):
    rc, (ok, rows) = _run(tmp_path)
    by = {(r["test"], tuple(sorted(r["params"].items()))): r for r in rows}
    assert len(rows) == 4, rows  # test_layer x 2, test_pairs (n=1), test_fails_everywhere
    refused = by[("test_layer", (("tp", "2"),))]
    assert refused["ring"] == "refused" and "expert tensor parallelism" in refused["why"]
    assert refused["why"].startswith("refused by the ring: ") and "fix:" in refused["why"]
    assert by[("test_layer", (("tp", "1"),))]["ring"] == "passed"
    assert by[("test_pairs", (("n", "1"),))]["ring"] == "passed"
    everywhere = by[("test_fails_everywhere", ())]
    assert everywhere["ring"] == everywhere["alltoall"] == "failed"
    assert not everywhere["against_ring"]  # the twin fails as well: not the ring's doing
    assert ok and rc == 1  # pytest's own status counts test_fails_everywhere


def test_a_ring_failure_where_alltoall_passes_fails_the_verdict(tmp_path):
    rc, (ok, rows) = _run(tmp_path, broken="the ring computed something else")
    (held,) = [r for r in rows if r["against_ring"]]
    assert held["test"] == "test_layer" and held["params"] == {"tp": "1"}
    assert held["ring"] == "failed" and "the ring computed something else" in held["why"]
    assert not ok


def test_the_runner_names_what_megatron_tests_it_needs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        runner.main(["--megatron-tests", str(tmp_path)])
    err = capsys.readouterr().err
    assert "test_moe_layer.py" in err and "core_v0.19" in err
