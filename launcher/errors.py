"""Errors every command shares."""


class UsageError(Exception):
    """Bad input from the user: printed as one line on stderr, exit code 2."""
