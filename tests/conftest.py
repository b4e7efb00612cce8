"""Suite-wide collection rules.

`make test` runs the suite in two pytest-xdist workers (`-n 2 --dist loadgroup`): on this kind of
machine the suite keeps one of its two cores busy on average, many tests waiting on Slurm, on
workers' steps or on a browser. The real Slurm testbed is one cluster on this machine, brought up
once per session, so every test that touches it goes to one worker, in collection order (the group
below); the others spread over the workers.
"""
from __future__ import annotations

import pytest

TESTBED_FIXTURES = {"slurm_testbed", "uneven"}
TESTBED_GROUP = "slurm-testbed"


def uses_testbed(item: pytest.Item) -> bool:
    """Marked slurm, asks for the testbed's fixtures, or lives in a module about Slurm or the testbed."""
    return (item.get_closest_marker("slurm") is not None
            or bool(TESTBED_FIXTURES & set(getattr(item, "fixturenames", ())))
            or any(word in item.nodeid.split("::")[0] for word in ("slurm", "testbed")))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if uses_testbed(item):
            item.add_marker(pytest.mark.xdist_group(TESTBED_GROUP))
