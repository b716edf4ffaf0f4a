"""Errors that the CLI turns into exit codes: a user's mistake exits 2, a runtime failure exits 1."""


class RsiError(Exception):
    """Base class for errors rsi reports without a traceback."""

    exit_code = 1


class UserError(RsiError):
    """Bad input (a file, an argument, a setting): the message names the thing and the fix."""

    exit_code = 2


class RuntimeFailure(RsiError):
    """Something that was asked correctly failed to happen (a service down, a lease held)."""

    exit_code = 1
