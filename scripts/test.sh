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
# Python's bytecode cache on (__pycache__/, ignored by git), whatever the environment says: the
# suite starts hundreds of Python processes, and without it each compiles again the relaymoe,
# benchmarks and test modules it imports (pytest rewrites and compiles every test module in each
# of its processes: seconds apiece).
unset PYTHONDONTWRITEBYTECODE
# Phase 1: everything but the tests marked `alone`, on the xdist workers. Phase 2: the `alone`
# tests (they check that a dead peer is named within a wall-clock timeout, so they run with no
# other test beside them), serially. Exit status 5 (nothing collected) in one phase is fine as
# long as the other ran tests.
# Phase 2 collects only the test files that mark tests `alone` (collecting the whole tree to
# deselect all but those takes seconds), unless an argument names a path: then pytest collects
# what the arguments say, as in phase 1.
# The last line sums up both phases (each phase's own summary line, from its log).
names_a_path() {  # whether an argument is an existing file or folder (FILE::TEST counts)
  local a
  for a in "$@"; do
    [ -e "${a%%::*}" ] && return 0
  done
  return 1
}
ALONE_FILES=()
if ! names_a_path "$@"; then
  mapfile -t ALONE_FILES < <(grep -rl --include='*.py' 'mark\.alone' tests | sort)
fi
LOGS="$(mktemp -d)"; trap 'rm -rf "$LOGS"' EXIT
set +e
"$PY" -m pytest -q -ra --durations=15 -n "${RELAYMOE_TEST_WORKERS:-2}" --dist loadgroup \
  -m "not alone" "$@" 2>&1 | tee "$LOGS/1"
rc1=${PIPESTATUS[0]}
"$PY" -m pytest -q -ra -p no:xdist -m alone "$@" "${ALONE_FILES[@]}" 2>&1 | tee "$LOGS/2"
rc2=${PIPESTATUS[0]}
set -e
summary() {  # pytest's last summary line of a phase ("N passed, M skipped ... in S s")
  grep -E '^(=+ )?([0-9]+ [a-z]+|no tests ran).* in [0-9.]+s' "$1" | tail -n 1 \
    | sed -E 's/^=+ //; s/ =+$//'
}
echo "[relaymoe] CPU suite: $(summary "$LOGS/1") (all but the 'alone' tests); \
$(summary "$LOGS/2") (the 'alone' tests, on their own)"
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
