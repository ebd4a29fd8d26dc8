"""``import_edges``: edge lists (TSV, CSV, Parquet) with string ids -> PBG's v1 input layout.

The input can be far larger than memory (100M+ edges), so it is streamed twice in bounded
chunks, never held whole; ids are hashed and deduplicated with numpy, never as Python objects.
The parts, in the order an import uses them:

- ``options``: ``ImportOptions``, ``ImportSummary`` and the up-front checks of a request;
- ``readers``: the input files as arrow batches; ``hashing`` and ``table``: dense ids per type;
- ``plan``, ``importer`` (the two passes), ``bucketing`` (pass 2), ``writing`` (the output);
- ``run``: ``import_edges``, which checks the request and the output locations first.
"""

from job.data.importing.hashing import hash_strings
from job.data.importing.importer import Importer
from job.data.importing.options import FORMATS, ImportOptions, ImportSummary, check_request
from job.data.importing.run import import_edges, import_pod
from job.data.importing.table import EntityTable

__all__ = [
    "FORMATS",
    "EntityTable",
    "ImportOptions",
    "ImportSummary",
    "Importer",
    "check_request",
    "hash_strings",
    "import_edges",
    "import_pod",
]
