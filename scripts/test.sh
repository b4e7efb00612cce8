#!/usr/bin/env bash
# The whole test suite, as `make test` (and CI) runs it: two pytest sessions side by side. One runs the
# tests on the Slurm testbed, one after another (they share one cluster); the other runs everything else.
# The Slurm tests mostly wait on Slurm and on paced steps, so together they take about as long as the
# longer of the two. Extra arguments go to both sessions. Exit status: non-zero when either failed.
set -uo pipefail
cd "$(dirname "$0")/.."
log="$(mktemp -t elastic-slurm-tests.XXXXXX)"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 -m "slurm and not fuzz" "$@" >"$log" 2>&1 &
slurm=$!
echo "tests on the Slurm testbed: running alongside, output in $log (printed at the end)"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -m "not slurm and not fuzz" "$@"
rest=$?
wait "$slurm"
on_slurm=$?
echo
echo "=== the tests on the Slurm testbed (exit $on_slurm) ==="
cat "$log"
echo "=== the rest: exit $rest; the Slurm tests: exit $on_slurm ==="
[ "$rest" -eq 0 ] && [ "$on_slurm" -eq 0 ]
