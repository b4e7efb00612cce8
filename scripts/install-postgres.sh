#!/usr/bin/env bash
# Install Debian's PostgreSQL server binaries for the tests, only if missing.
#
# The test suite starts its own throwaway server from them (tests/db/backends.py: initdb into a
# temp dir, 127.0.0.1 and a free port), so the system cluster Debian would start is not wanted:
# policy-rc.d keeps maintainer scripts from starting services. Idempotent: with initdb present this
# does nothing (no network, no apt lock). `apt-get update` runs only if the install fails (a fresh
# image has empty or stale package lists).
set -euo pipefail

have() { compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; }
if have; then
    echo "install-postgres: already installed ($(ls -d /usr/lib/postgresql/*/ | xargs -n1 basename | tr '\n' ' '))" >&2
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install-postgres: no /usr/lib/postgresql/*/bin/initdb and not root; run: sudo apt-get install -y postgresql" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# shellcheck source=apt-no-services.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt-no-services.sh"

# Other sessions may hold the dpkg lock: wait for it instead of failing.
APT=(apt-get -o DPkg::Lock::Timeout=900 -o Acquire::Retries=3)
install() { "${APT[@]}" install -y -qq --no-install-recommends postgresql >&2; }
echo "install-postgres: installing postgresql with apt" >&2
if ! install; then
    echo "install-postgres: install failed; updating the package lists and trying again" >&2
    "${APT[@]}" update -qq >&2
    install || { echo "install-postgres: apt-get could not install postgresql" >&2; exit 1; }
fi
have || { echo "install-postgres: postgresql installed but no /usr/lib/postgresql/*/bin/initdb" >&2; exit 1; }
echo "install-postgres: ok ($(ls -d /usr/lib/postgresql/*/ | xargs -n1 basename | tr '\n' ' '))" >&2
