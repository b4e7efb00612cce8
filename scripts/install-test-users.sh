#!/usr/bin/env bash
# The cluster's users the multi-user tests act as (tests/service): two users and an operator, real Unix
# accounts, as on a cluster. The operator is a member of the group the service is told its operators are.
# And the project's interpreter must be runnable by them: every directory above .venv's real python and above
# the project gets the search bit for others (o+x: enter, not list), e.g. /root, where pyenv's Python lives.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
getent group elastic-operators >/dev/null || groupadd --system elastic-operators
for user in elastic-alice elastic-bob elastic-ops; do
  id -u "$user" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$user"
done
usermod -a -G elastic-operators elastic-ops
python="$(readlink -f "$ROOT/.venv/bin/python")"
for path in "$(dirname "$python")" "$ROOT"; do
  while [ "$path" != "/" ]; do
    [ -n "$(find "$path" -maxdepth 0 -perm -o+x)" ] || { echo "install-test-users: o+x on $path" >&2; chmod o+x "$path"; }
    path="$(dirname "$path")"
  done
done
# their password for the dashboard's PAM login test (tests/dashboard/test_site_login.py): test accounts only
for user in elastic-alice elastic-bob elastic-ops; do echo "$user:elastic-test-pw-$user" | chpasswd; done
