"""The elastic launcher: processes, Slurm, and the control plane around the migration core."""
