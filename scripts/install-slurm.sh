#!/usr/bin/env bash
# Install the Debian packages the loopback Slurm testbed needs, only if missing.
#
# Idempotent: when every package is already installed this does nothing (no
# network, no apt lock), so launcher/testbed.py can call it on every `up()`.
# `apt-get update` runs only when something has to be installed, because a
# fresh Debian 12 image has empty package lists.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

if [[ $(id -u) -ne 0 ]]; then
    echo "install-slurm.sh: must run as root (apt-get install needs it)" >&2
    exit 1
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    if [[ $status != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install-slurm.sh: all packages already installed"
    exit 0
fi

echo "install-slurm.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Keep package maintainer scripts from starting system services: the testbed
# runs its own daemons with its own configs and ports.
# shellcheck source=apt-no-services.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt-no-services.sh"

apt-get update -qq
apt-get install -y -qq --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
    "${missing[@]}" >/dev/null
echo "install-slurm.sh: done"
