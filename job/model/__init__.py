"""PBG's scoring model, shared by training, evaluation, the archive writer and the report.

- ``job.model.names``: the operator, comparator and loss names (torch-free; the config's choices)
- ``job.model.registry``: ``Registry``, name -> implementation, filled by decorators
- ``job.model.operators``, ``comparators``, ``losses``: the torch implementations, registered by name
- ``job.model.scoring``: ``Model`` (operators, global embeddings, batch scoring), ``Table``, ``SideScores``
- ``job.model.fused``: the training hot path, negative scoring and loss differentiated by hand

This package's ``__init__`` imports nothing: ``job.config`` and the numpy archive reader import
``job.model.names`` and ``job.model.registry`` and must not pull torch in with them. Import the
torch parts from their modules (``from job.model.scoring import Model``).
"""
