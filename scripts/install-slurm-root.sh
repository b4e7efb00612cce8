#!/usr/bin/env bash
# Build (once, then cached) a Debian root holding another Slurm release from Debian's own packages,
# for `elastic testbed up --slurm VERSION`: 24.11 is Debian trixie's Slurm, 26.05 Debian sid's.
#
# The root gets the same daemons the 22.05 testbed runs on the host (slurmctld, slurmd, slurmdbd,
# munge, MariaDB) and the shared libraries this machine's Python needs to run inside it: the
# project and its interpreter are bind-mounted into the root at their own paths
# (launcher/testbed/roots.py), so the CPU torch wheel installed for the host's Python serves there
# too (the root's own Python is another version, and the package index's torch for it is a CUDA
# build). Idempotent: a root whose stamp names the same package list is left as it is.
set -euo pipefail

VERSION="${1:?usage: install-slurm-root.sh 24.11|26.05 [ROOT]}"
case "$VERSION" in
    24.11) SUITE=trixie ;;
    26.05) SUITE=sid ;;
    *) echo "install-slurm-root.sh: no Debian suite ships Slurm $VERSION here (choose 24.11 or 26.05)" >&2; exit 2 ;;
esac
ROOT="${2:-/var/cache/elastic-testbed/roots/slurm-$VERSION}"
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server
          python3 libsqlite3-0 libstdc++6 procps)
STAMP="$ROOT/.elastic-root"
WANT="$SUITE ${PACKAGES[*]}"

if [[ $(id -u) -ne 0 ]]; then
    echo "install-slurm-root.sh: must run as root (debootstrap and chroot need it)" >&2
    exit 1
fi
if [[ -f $STAMP && "$(head -1 "$STAMP")" == "$WANT" ]]; then
    echo "install-slurm-root.sh: $ROOT is ready ($(sed -n 2p "$STAMP"))"
    exit 0
fi

# The mirror this machine's apt uses (deb822 or one-line sources).
MIRROR=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -1)
if [[ -z $MIRROR ]]; then
    MIRROR=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
fi
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

export DEBIAN_FRONTEND=noninteractive
if ! command -v debootstrap >/dev/null; then
    echo "install-slurm-root.sh: installing debootstrap"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi

# Never delete through a mount: a root a testbed runs in has the project bind-mounted into it.
if grep -q " $ROOT" /proc/mounts; then
    echo "install-slurm-root.sh: $ROOT has mounts (a testbed of Slurm $VERSION is up?); run 'elastic testbed down --slurm $VERSION' first" >&2
    exit 1
fi
echo "install-slurm-root.sh: building a $SUITE root for Slurm $VERSION in $ROOT (about 2 minutes, once)"
rm -rf "$ROOT" "$ROOT.part"
mkdir -p "$(dirname "$ROOT")"
debootstrap --variant=minbase "$SUITE" "$ROOT.part" "$MIRROR" >"$ROOT.log" 2>&1 \
    || { echo "install-slurm-root.sh: debootstrap failed; see $ROOT.log" >&2; exit 1; }
cp /etc/hosts "$ROOT.part/etc/hosts"
# Package scripts must not start services in the root: the testbed runs its own daemons.
printf '#!/bin/sh\nexit 101\n' > "$ROOT.part/usr/sbin/policy-rc.d"
chmod 755 "$ROOT.part/usr/sbin/policy-rc.d"
mount -t proc proc "$ROOT.part/proc"
trap 'umount "$ROOT.part/proc" 2>/dev/null || true' EXIT
# sid's Release file can be past its Valid-Until date on a mirror snapshot.
chroot "$ROOT.part" apt-get -o Acquire::Check-Valid-Until=false update -qq >>"$ROOT.log" 2>&1
chroot "$ROOT.part" apt-get install -y -qq --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
    "${PACKAGES[@]}" >>"$ROOT.log" 2>&1 \
    || { echo "install-slurm-root.sh: apt-get install in the root failed; see $ROOT.log" >&2; exit 1; }
chroot "$ROOT.part" apt-get clean
umount "$ROOT.part/proc"
trap - EXIT
got=$(chroot "$ROOT.part" slurmctld -V)
case "$got" in
    *" $VERSION".*) ;;
    *) echo "install-slurm-root.sh: the $SUITE root has '$got', not Slurm $VERSION" >&2; exit 1 ;;
esac
printf '%s\n%s\n' "$WANT" "$got" > "$ROOT.part/.elastic-root"
mv "$ROOT.part" "$ROOT"
echo "install-slurm-root.sh: $ROOT holds $got"
