#!/usr/bin/env bash
# Install what the @pytest.mark.browser tests need, only if it is missing:
#   - Debian's chromium (apt), because `playwright install` downloads its own
#     browser build, which this project's machines cannot fetch;
#   - the pip package `playwright` into the project venv (just the driver).
# Idempotent and quiet on the happy path; exits non-zero with a reason otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${ELASTIC_VENV_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"

if ! [ -x /usr/bin/chromium ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install-browser: /usr/bin/chromium missing and not root; run: sudo apt-get install -y chromium" >&2
    exit 1
  fi
  echo "install-browser: installing chromium with apt" >&2
  export DEBIAN_FRONTEND=noninteractive
  # Other sessions may hold the dpkg lock: wait for it instead of failing.
  APT=(apt-get -o DPkg::Lock::Timeout=900 -o Acquire::Retries=3)
  for try in 1 2 3; do
    "${APT[@]}" update -qq >&2 && "${APT[@]}" install -y -qq --no-install-recommends chromium fonts-dejavu-core >&2 && break
    [ "$try" -eq 3 ] && { echo "install-browser: apt-get could not install chromium" >&2; exit 1; }
    sleep 10
  done
fi

if ! "$PY" -c "import playwright.sync_api" 2>/dev/null; then
  echo "install-browser: installing the playwright pip package into $PY" >&2
  "$PY" -m pip install -q playwright >&2
fi

/usr/bin/chromium --version >/dev/null 2>&1 || { echo "install-browser: /usr/bin/chromium does not run" >&2; exit 1; }
"$PY" -c "import playwright.sync_api" || { echo "install-browser: playwright still not importable" >&2; exit 1; }
echo "install-browser: ok ($(/usr/bin/chromium --version 2>/dev/null | head -1))" >&2
