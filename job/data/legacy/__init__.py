"""``convert_legacy`` (``biggraph convert-legacy``): pre-1.0 PBG inputs and checkpoints -> the v1 format.

Legacy layout (spec: pbg-data-model-and-legacy-format.rst) and what each becomes:

- ``entity_count_{type}_{part}.pt`` (a ``torch.save``'d int) -> ``entity_count_{type}_{part}.txt``.
  Count files are 0-based like v1; with ``--count-base auto`` a type that has a ``_1``
  file but no ``_0`` file is taken as 1-based and shifted down (logged).
  ``dynamic_rel_count.pt`` -> ``dynamic_rel_count.txt``; ``entity_names_*.json`` and
  ``dynamic_rel_names.json`` are copied (renumbered with the counts).
- ``edges_{l}_{r}.h5``: same datasets; legacy files lack the ``format_version``
  attribute, which the copy gets (= 1). Other attributes and datasets (``lhsd_*``) are kept.
- checkpoints: ``CHECKPOINT_VERSION`` (the latest version N), ``METADATA_1.pt.N`` (a
  5-tuple: config dict, two ints, model state dict, optimizer state) and
  ``{type}_{part}.pt.N`` with a **1-based** partition (a 2-tuple: embeddings, possibly an
  ``nn.Parameter``, and their optimizer state). Without ``CHECKPOINT_VERSION`` the files
  may carry no suffix (an initial-embeddings directory) and METADATA may be absent.
  These become a v1 checkpoint of version N (1 when unversioned) written through
  ``CheckpointStorage``: ``embeddings_{type}_{part-1}.vN.h5``, ``model.vN.h5`` (state-dict
  names mapped as PBG's MODEL_STATE_DICT_MAPPINGS: ``{side}_operators.{idx}.{param}`` ->
  ``relations/{idx}/operator/{side}/{param}``, ``global_embs.emb_{type}`` ->
  ``entities/{type}/global_embedding``), ``config.json`` and, last, ``checkpoint_version.txt``.

The legacy config dict: mixedCase keys become snake_case (as PBG 1.0's own loader does),
``outdir`` becomes ``checkpoint_path`` and ``loadPath`` ``init_path``; keys unknown to the v1
schema are dropped (logged). ``entity_path``/``edge_paths``/``checkpoint_path`` are pointed at
the converted directories when those are converted in the same run. If the result is still
not a valid config, the mapped dict is written as is (with a warning); ``--config`` supplies
a v1 config to use instead. The two METADATA ints (whose packing of epoch/edge path/chunk
is unspecified) are kept as the ``legacy/metadata_int_1``/``legacy/metadata_int_2`` attributes.

SECURITY: every ``.pt`` file is untrusted and is loaded only with
``torch.load(weights_only=True)``: tensors (``nn.Parameter`` included), numbers, strings and
containers. Anything else (a custom class, a ``__reduce__`` calling a function) is refused
with an error naming the file; there is no fallback to full unpickling.

Parts: ``loading`` (safe ``.pt`` loading), ``inputs`` (entity and edge paths), ``config_map``
(config keys and state-dict names), ``checkpoint``, ``convert`` (``convert_legacy``).
"""

from job.data.legacy.checkpoint import convert_checkpoint
from job.data.legacy.config_map import map_legacy_config, map_state_dict_key
from job.data.legacy.convert import LegacyConversion, convert_legacy
from job.data.legacy.inputs import EntityConversion, convert_edges, convert_entities
from job.data.legacy.loading import LegacyFormatError, safe_torch_load

__all__ = [
    "EntityConversion",
    "LegacyConversion",
    "LegacyFormatError",
    "convert_checkpoint",
    "convert_edges",
    "convert_entities",
    "convert_legacy",
    "map_legacy_config",
    "map_state_dict_key",
    "safe_torch_load",
]
