"""A real Slurm cluster on loopback (slurmctld, one slurmd per node, slurmdbd, MariaDB) for tests and demos.

From the bottom up: errors; config (the shape and the configuration text, pure); layout (the files
on disk); daemons (the processes, by pid file); services (the Slurm packages, munge, MariaDB);
cluster (`Testbed`, the one door the CLI and the tests use).
"""
