#!/usr/bin/env bash
# Everything the test suite needs beyond Python packages: Slurm 22.05 (+ munge, slurmdbd, MariaDB)
# for the real-cluster tests, Debian roots holding Slurm 24.11 (trixie) and 26.05 (sid) for the same tests on
# those releases (scripts/install-slurm-root.sh; cached, about 2 minutes each the first time), Debian's Chromium + Playwright for the browser tests, and Debian's
# PostgreSQL server for the tests that run the database layer and the dashboard on PostgreSQL.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/install-slurm.sh"
"$ROOT/scripts/install-slurm-root.sh" 24.11
"$ROOT/scripts/install-slurm-root.sh" 26.05
"$ROOT/scripts/install-browser.sh"
"$ROOT/scripts/install-postgres.sh"
"$ROOT/scripts/install-docs-deps.sh"
"$ROOT/scripts/install-test-users.sh"
