#!/usr/bin/env bash
# The Slurm part of the suite on the releases beside the host's: the whole of it on the newest (26.05), the
# core set (marker slurm_core) on 24.11; the host's 22.05 ran the core set and the Slurm tests that need
# Chromium or PostgreSQL in the main run (`make test`). Each release runs in its Debian root
# (`elastic testbed run --slurm R`), with its own testbed, taken down afterwards.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10)
status=0
run() {
    local release=$1 marks=$2
    echo "== Slurm $release: pytest -m \"$marks\"" >&2
    .venv/bin/elastic testbed run --slurm "$release" -- "${PYTEST[@]}" -m "$marks" || status=1
    .venv/bin/elastic testbed down --slurm "$release" >/dev/null 2>&1 || true
}
run 24.11 "slurm_core and not fuzz"
run 26.05 "slurm and not slurm_host and not fuzz"
exit $status
