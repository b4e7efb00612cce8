#!/bin/bash
# How sinfo-plain.json, squeue-plain.json and reservations-plain.txt were recorded on the testbed
# (`elastic testbed up`; run under `flock /tmp/elastic-slurm.lock`). It cancels every job first.
set -u
export SLURM_CONF=${SLURM_CONF:-/tmp/elastic-testbed/etc/slurm.conf}
out=$(dirname "$0")
squeue -h -o %i | xargs -r scancel; sleep 2
a=$(sbatch --parsable -J plain-a -N1 -w n1 --gres=gpu:1 --wrap 'sleep 120')
b=$(sbatch --parsable -J plain-b -N1 -w n1 --gres=gpu:2 --wrap 'sleep 120')
c=$(sbatch --parsable -J elastic-x -N2 -w n2,n3 --gres=gpu:4 --wrap 'sleep 120')
scontrol update NodeName=n4 State=DRAIN Reason=disk-check
scontrol create reservation ReservationName=maint StartTime=now Duration=10 Nodes=n3 Users=root Flags=IGNORE_JOBS
sleep 3
sinfo --json > "$out/sinfo-plain.json"
squeue --json > "$out/squeue-plain.json"
scontrol -o show reservation > "$out/reservations-plain.txt"
scancel "$a" "$b" "$c"
scontrol delete ReservationName=maint
scontrol update NodeName=n4 State=RESUME
