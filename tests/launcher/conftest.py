"""Fixtures for launcher tests. `slurm_testbed` brings the real loopback Slurm
cluster up once per session (installing Slurm if needed) and yields it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from launcher.testbed.cluster import Testbed
from launcher.testbed.config import DEFAULT_ROOT


@pytest.fixture(scope="session")
def slurm_testbed() -> Iterator[Testbed]:
    """The 4-node testbed, up. Skips only when not root: anything else that stops
    Slurm from coming up is a failure, so a broken install never hides as a skip.

    It is taken down at the end only if this session brought it up, so a
    testbed someone started by hand (`elastic testbed up`) stays up.
    """
    if os.geteuid() != 0:
        pytest.skip("the Slurm testbed needs root (it starts slurmd, munged and MariaDB)")
    testbed = Testbed(Path(os.environ.get("ELASTIC_TESTBED_ROOT", DEFAULT_ROOT)))
    was_up = testbed.is_up()
    testbed.up()  # raises TestbedError with the log files to read
    yield testbed
    if not was_up:
        testbed.down()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the uneven testbed run last, one after another, so it is reshaped once and back once
    (about 5 s each way with jobs to drain), not once per module that uses it."""
    last = [item for item in items if "uneven" in getattr(item, "fixturenames", ())]
    if last:
        items[:] = [item for item in items if "uneven" not in getattr(item, "fixturenames", ())] + last


@pytest.fixture(scope="session")
def uneven(slurm_testbed: Testbed) -> Iterator[Testbed]:
    """The testbed in shape 4,4,2,2 (partitions gpu4 = n1,n2 and gpu2 = n3,n4); the default shape
    is back afterwards, for the other Slurm tests (which run before: pytest_collection_modifyitems)."""
    testbed = Testbed(slurm_testbed.root, gpus=(4, 4, 2, 2))
    testbed.up()
    try:
        yield testbed
    finally:
        slurm_testbed.up()
