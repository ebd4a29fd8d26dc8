"""Errors of the model archive; each names the archive and, where there is one, the member at fault."""

from __future__ import annotations

from typing import Optional

from job.errors import UserError


class ArchiveError(UserError):
    """The archive (or one of its members) cannot be read or written as asked."""

    def __init__(self, archive: str, problem: str, member: Optional[str] = None) -> None:
        self.archive = archive
        self.member = member
        self.problem = problem
        where = f"{archive}: member '{member}'" if member is not None else archive
        super().__init__(f"{where}: {problem}")


class ArchiveFormatError(ArchiveError):
    """Not a readable zip, a compressed member, a malformed text member or FlatBuffer."""


class ArchiveIntegrityError(ArchiveError):
    """A member is truncated or its bytes do not match the CRC-32 recorded in the zip."""


class TagError(ArchiveError):
    """An unknown, duplicate or invalid tag."""


class DanglingReferenceError(ArchiveError):
    """params.txt/updater.txt points at a tag or a file the archive does not hold."""


class ShapeMismatchError(ArchiveError):
    """An array's shape or dtype differs from what graph.fb declares for it."""


class QueryError(UserError):
    """A query names an entity, entity type or relation the model does not have."""
