#!/usr/bin/env bash
# The user's guide's tools (pyproject.toml's `docs` extra: MkDocs, Material, mkdocstrings) into .venv, once
# (idempotent): `make docs` runs it, and so does scripts/install-test-deps.sh, since the suite builds the site.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
"$ROOT/scripts/bootstrap.sh"
if ! .venv/bin/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
  echo "install-docs-deps: installing the docs extra into .venv (mkdocs, mkdocs-material, mkdocstrings-python)" >&2
  .venv/bin/pip install -q --disable-pip-version-check -e '.[docs]' 2>&1 | grep -v "^WARNING: Location" >&2 || true
  .venv/bin/python -c "import mkdocs, material, mkdocstrings_handlers.python" \
    || { echo "install-docs-deps: the install did not complete; see the pip output above" >&2; exit 1; }
fi
