"""The storage layer's own errors: it sits below ``job`` and does not import it.

``StorageError`` is something the user can fix (a URL with no backend, access refused, a bucket that does not
exist, an endpoint that cannot be reached, retries exhausted): one line naming the URL, exit code 2 at the
command line, like ``job.errors.UserError``. ``NotHDF5Error`` says that an object's bytes are not an HDF5 file;
the format layer turns it into an input-format error naming the dataset it wanted.
"""

from __future__ import annotations


class StorageError(Exception):
    """A URL cannot be used as asked; the message names the URL (never a credential)."""

    exit_code = 2


class NotHDF5Error(OSError):
    """h5py could not open the object as an HDF5 file (its reason is in the message)."""

    def __init__(self, url: str, reason: str, detail: str = "") -> None:
        super().__init__(f"{url}: not a readable HDF5 file ({reason})")
        self.url = url
        self.reason = reason
        self.detail = detail or reason  # HDF5's whole message (it tells a truncated file from garbage)


class ConditionFailed(StorageError):
    """A conditional write found the object changed (or present, or gone) since the caller last read it:
    another writer got there first. Raised only by :func:`storage_adapters.write_if`."""
