"""The data tools: getting graphs into biggraph's input layout and embeddings out of its checkpoints.

- ``importing``: ``import_edges`` turns TSV/CSV/Parquet edge lists with string ids into PBG's v1 input.
- ``export``: ``export_checkpoint`` writes a checkpoint's embeddings as TSV (PBG's layout), .npy or Parquet.
- ``legacy``: ``convert_legacy`` turns pre-1.0 PBG inputs and checkpoints into v1.
- ``datasets``: the small demo graphs (UMLS, Kinships, Nations).
- ``outputs``: the check, run before any work, that an output location can be written.

Library code only: the ``biggraph`` subcommands that call these live in ``job.cli``.
"""
