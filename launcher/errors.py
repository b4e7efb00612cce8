"""Errors every command shares."""


class UsageError(Exception):
    """Bad input from the user: printed as one line on stderr, exit code 2."""


class NothingToDo(Exception):
    """The command has nothing to do (e.g. a successor whose job ended cleanly): its message says why; exit 0."""
