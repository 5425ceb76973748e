#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 and install the project with its dev extra.
set -euo pipefail
cd "$(dirname "$0")"

ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python() {
  local c
  for c in "${PYTHON:-}" python3.13 python3.12 python3; do
    if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && ok "$(command -v "$c")"; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in "$(pyenv root)"/versions/3.1[2-9]*/bin/python; do
      if [ -x "$c" ] && ok "$c"; then echo "$c"; return 0; fi
    done
  fi
  for c in /usr/bin/python3.1[2-9] /usr/local/bin/python3.1[2-9] "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    if [ -x "$c" ] && ok "$c"; then echo "$c"; return 0; fi
  done
  echo "setup.sh: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
  return 1
}

PY=$(find_python)
echo "setup.sh: using $PY ($("$PY" --version))"
[ -x .venv/bin/python ] && ok .venv/bin/python || "$PY" -m venv --clear .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
echo "setup.sh: ready (.venv)"
