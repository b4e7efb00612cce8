"""The shared service (`elastic serve`): one process holds the database; the CLI, the launchers and the browser
talk to it, proving who they are with the cluster's own identity (munge), and may do what Slurm would let them
do to their jobs (service.authz). Nothing here imports the launcher: the service's command builds it."""
