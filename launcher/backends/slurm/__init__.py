"""Slurm, from the bottom up: host lists (hostlist), GRES strings (gres), command lines (commands) and
the parsers of what Slurm prints (parse), all pure; the allocation as Slurm shows it (allocation) and
which jobs hold the nodes (holdings); the clients that run the commands (client) or use pyslurm
(pyslurm), and the choice between them (select); the node backend built on them (nodes). Each
imports only modules listed before it."""
