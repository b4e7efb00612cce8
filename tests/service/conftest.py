"""The service tests use the Slurm testbed (its munged and slurmctld) that the launcher tests bring up."""
from tests.launcher.conftest import slurm_testbed  # noqa: F401  (a fixture)
