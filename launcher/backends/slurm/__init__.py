"""Slurm: pure command builders and parsers, the allocation as Slurm shows it, the client that runs the
commands (or pyslurm), and the node backend built on them."""
