"""Every path is a URL: one thin layer over fsspec used by all of biggraph's I/O.

Plain paths and ``file://`` go to the local filesystem (and h5py opens them
directly), through ``os`` (:mod:`~storage_adapters.local`, answering as fsspec's
``LocalFileSystem`` would, without importing fsspec); any other scheme (``s3://``,
``memory://``, ``gs://``, ``az://`` ...) goes through the fsspec backend registered for
it, imported lazily so that a missing optional package is reported with the name of
what to install. URLs are joined as
strings, never through ``pathlib.Path`` (which would turn ``s3://b/k`` into ``s3:/b/k``).

Remote calls go through :func:`storage_adapters.retry.call_with_retry`: transient
failures (timeouts, dropped connections, 5xx, throttling) are retried with backoff for a
bounded time, each retry logged; permanent ones (no such bucket, access denied) and an
endpoint that cannot be reached at all (DNS, refused, TLS: a mistyped ``endpoint_url``)
raise ``StorageError`` at once, naming the URL. ``FileNotFoundError`` for a missing object
passes through.

Extra filesystem arguments come from the config key ``storage_options``: either one
mapping for every remote scheme (``{"endpoint_url": "http://minio:9000"}``) or one per
scheme (``{"s3": {...}, "gs": {...}}``). They are never logged or put in messages. They are
not process settings: a job passes them with ``using(StorageSettings(options=...))``
(:mod:`storage_adapters.session`), and they apply to the calls made inside that block.

The code is split by concern - :mod:`~storage_adapters.fs` (schemes, filesystems, the retried call),
:mod:`~storage_adapters.ops` (operations on one URL), :mod:`~storage_adapters.staging` (local stand-ins,
uploads' staging directories, copies), :mod:`~storage_adapters.multipart` (large S3 objects in bounded memory,
completions settled by the object) - and every name is re-exported here: callers write
``import storage_adapters as storage; storage.read_text(url)``.
"""

from __future__ import annotations

from storage_adapters.conditional import read_tagged, sync_directory, write_if
from storage_adapters.errors import ConditionFailed, NotHDF5Error, StorageError
from storage_adapters.fs import (
    S3_SCHEMES,
    get_filesystem,
    is_local,
    join,
    local_path,
    local_path_if_local,
    renames_into_place,
    scheme_of,
    storage_options_for,
)
from storage_adapters.ops import (
    append_text,
    change_marker,
    check_bucket,
    exists,
    get_file,
    info,
    isdir,
    listdir,
    makedirs,
    open_file,
    put_file,
    read_bytes,
    read_many,
    read_text,
    remove,
    remove_many,
    size,
    tree_listing,
    write_bytes,
    write_text,
)
from storage_adapters.session import StorageSession, StorageSettings, carry, current, using
from storage_adapters.staging import (
    UPLOAD_DIR_PREFIX,
    copy,
    local_copy_for_reading,
    local_file_for_writing,
    move,
    remove_stale_upload_dirs,
    upload_staging_dir,
)

__all__ = [
    "S3_SCHEMES", "ConditionFailed", "NotHDF5Error", "StorageError", "StorageSession", "StorageSettings", "carry",
    "current", "using",
    "UPLOAD_DIR_PREFIX", "remove_stale_upload_dirs", "upload_staging_dir",
    "check_bucket", "copy", "exists", "get_file", "get_filesystem", "info", "is_local", "isdir", "join", "listdir",
    "local_copy_for_reading", "local_file_for_writing", "local_path", "makedirs", "open_file", "put_file",
    "read_bytes", "read_many", "read_text", "remove", "remove_many", "scheme_of", "size", "storage_options_for", "tree_listing",
    "write_bytes", "write_text", "read_tagged", "write_if", "sync_directory", "append_text", "move",
    "change_marker", "local_path_if_local", "renames_into_place",
]
