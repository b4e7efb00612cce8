"""A real Slurm cluster on loopback (slurmctld, one slurmd per node, slurmdbd, MariaDB) for tests and demos."""
