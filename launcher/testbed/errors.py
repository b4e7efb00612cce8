"""The one error of the testbed, in a module of its own so every part of the testbed can raise it."""
from __future__ import annotations


class TestbedError(RuntimeError):
    """The testbed could not be brought up or down; the message says where to look."""

    __test__ = False  # not a pytest test class despite the name
