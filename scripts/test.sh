#!/usr/bin/env bash
# The CPU test suite, from nothing: creates .venv (Python 3.12), installs relaymoe[dev], runs pytest.
# Triton kernels run in Triton's CPU interpreter; ring tests spawn gloo process groups.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -k routing
# Two pytest-xdist workers (RELAYMOE_TEST_WORKERS=N for N; -n 0 or RELAYMOE_TEST_WORKERS=0 runs
# serially); --dist loadgroup keeps the tests sharing a spawned world on one worker.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Phase 1: everything but the tests marked `alone`, on the xdist workers. Phase 2: the `alone`
# tests (they check that a dead peer is named within a wall-clock timeout, so they run with no
# other test beside them), serially. Exit status 5 (nothing collected) in one phase is fine as
# long as the other ran tests.
set +e
"$PY" -m pytest -q -ra --durations=15 -n "${RELAYMOE_TEST_WORKERS:-2}" --dist loadgroup \
  -m "not alone" "$@"
rc1=$?
"$PY" -m pytest -q -ra -p no:xdist -m alone "$@"
rc2=$?
set -e
if [ "$rc1" -eq 5 ] && [ "$rc2" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
for rc in "$rc1" "$rc2"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    exit "$rc"
  fi
done
exit 0
