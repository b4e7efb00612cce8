"""The Slurm testbed for the guide's Slurm page (the same fixture as the launcher's Slurm tests)."""
from tests.launcher.conftest import slurm_testbed  # noqa: F401  (a pytest fixture, used by name)
