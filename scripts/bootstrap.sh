#!/usr/bin/env bash
# Create the project's virtual environment and install the project into it (idempotent).
# torch is pinned to 2.13.0 (CPU build on this kind of machine); see pyproject.toml.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.elastic-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing the project and its test tools into .venv (torch==2.13.0 takes ~20 s)" >&2
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "^WARNING: Location" >&2 || true
  .venv/bin/python -c "import torch, scipy, sqlalchemy, flask, xxhash, pytest, hypothesis" \
    || { echo "bootstrap: the install did not complete; see the pip output above" >&2; exit 1; }
  touch "$stamp"
fi
