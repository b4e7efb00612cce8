#!/usr/bin/env bash
# Everything the test suite needs beyond Python packages: Slurm 22.05 (+ munge, slurmdbd, MariaDB)
# for the real-cluster tests, Debian's Chromium + Playwright for the browser tests, and Debian's
# PostgreSQL server for the tests that run the database layer and the dashboard on PostgreSQL.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/install-slurm.sh"
"$ROOT/scripts/install-browser.sh"
"$ROOT/scripts/install-postgres.sh"
