"""``export_checkpoint`` (``biggraph export``): a committed checkpoint as TSV, NumPy or Parquet files.

Why a separate command: checkpoints are HDF5 files split by partition and keyed by
offset, which is what training needs but not what downstream users (nearest-neighbour
indexes, notebooks, warehouses) want. Export joins each partition's embeddings with the
entity names written by the importer and writes one of:

- ``tsv``: exactly PBG's ``torchbiggraph_export_to_tsv`` layout, so scripts written for
  PBG keep working: ``entity_embeddings.tsv`` (name, then the values as ``%.9f``,
  tab-separated) and ``relation_types_parameters.tsv`` (relation name, side, operator,
  parameter name, shape ``AxB``, then the flattened values). ``--entities-output`` /
  ``--relation-types-output`` name the two files directly, as PBG's flags do.
- ``npy``: ``embeddings_{type}.npy`` (all partitions concatenated in partition order),
  ``names_{type}.json`` (same row order), ``relations.npz`` + ``relations.json``.
- ``parquet``: ``embeddings.parquet`` with columns ``entity_type, partition, offset,
  name, embedding (list<float32>)`` written one bounded row group at a time, and
  ``relations.parquet``.

Every format also gets ``manifest.json`` (checkpoint version, row ranges of each
partition, where the names came from), except when the TSV files are named directly.

Memory stays bounded by one partition: partitions are read, written and dropped one at
a time (the ``.npy`` header is rewritten at the end once the row count is known).

As PBG's exporter does, the learned global embedding of a type (if the model has one)
is added to every embedding of that type, since that sum is what the model scores with;
``--no-global-emb`` exports the raw table instead.

Parts: ``reader`` (the checkpoint, a partition at a time), ``writers`` (the layouts), ``run``.
"""

from job.data.export.reader import CheckpointReader, ExportError, ExportSummary, PartitionInfo, RelationParam
from job.data.export.run import export_checkpoint
from job.data.export.writers import DEFAULT_ROW_GROUP_ROWS, FORMATS

__all__ = [
    "DEFAULT_ROW_GROUP_ROWS",
    "FORMATS",
    "CheckpointReader",
    "ExportError",
    "ExportSummary",
    "PartitionInfo",
    "RelationParam",
    "export_checkpoint",
]
