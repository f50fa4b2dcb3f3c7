# Sourced by the project's scripts: find Python 3.12, create .venv and install relaymoe[dev] once.
# Usage: source scripts/_env.sh   (sets PY to the venv's python)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RELAYMOE_VENV:-$ROOT/.venv}"

find_python312() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1; then
    command -v python3.12; return
  fi
  local cand
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python; do
    [ -x "$cand" ] && { echo "$cand"; return; }
  done
  echo "relaymoe needs Python 3.12 (megatron-core >= 0.17 requires it): install python3.12" \
       "or a pyenv 3.12 and rerun" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY312="$(find_python312)"
  echo "[relaymoe] creating $VENV with $PY312"
  "$PY312" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Reinstall when pyproject.toml changed since the last install (editable install otherwise).
STAMP="$VENV/.relaymoe-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "[relaymoe] installing relaymoe[dev] into $VENV (first run downloads torch, ~3 GB)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -e "$ROOT[dev]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
