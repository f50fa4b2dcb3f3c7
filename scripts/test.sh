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
set +e
"$PY" -m pytest -q -ra --durations=15 -n "${RELAYMOE_TEST_WORKERS:-2}" --dist loadgroup "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
