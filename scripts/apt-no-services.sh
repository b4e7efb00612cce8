# Sourced by the install scripts: while they run, package maintainer scripts may not start system
# services (policy-rc.d exit 101 tells invoke-rc.d "not allowed"): the tests and the testbed run
# their own daemons with their own configs and ports. The file is removed again on exit unless it
# was there before.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    created_policy=1
fi
cleanup() { if [[ $created_policy -eq 1 ]]; then rm -f "$policy"; fi; }
trap cleanup EXIT
