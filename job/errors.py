"""User-facing errors.

Anything the user can fix (a bad config key, a malformed input file) raises a
``UserError``; the CLI prints its one-line message and exits with code 2 and no
traceback. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, reported as one line and exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """The configuration names an unknown key, has a wrong type or an impossible combination."""


class InputFormatError(UserError):
    """An input file does not follow the PBG input format.

    The message always names the file, and where it applies the dataset, the
    first offending row and what was expected there.
    """

    def __init__(
        self,
        file: str,
        problem: str,
        *,
        dataset: str | None = None,
        row: int | None = None,
        expected: str | None = None,
    ) -> None:
        self.file = file
        self.dataset = dataset
        self.row = row
        self.problem = problem
        self.expected = expected
        where = file
        if dataset is not None:
            where += f" dataset '{dataset}'"
        if row is not None:
            where += f" row {row}"
        message = f"{where}: {problem}"
        if expected is not None:
            message += f" (expected {expected})"
        super().__init__(message)


class CheckpointError(UserError):
    """A checkpoint directory is missing, incomplete or in an unknown format."""
