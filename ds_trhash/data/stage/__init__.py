"""A stage's data, as training takes it: one call opens it, one interface reads it.

* ``opening`` - ``open_stage_data(StageRequest) -> StageData``: the replay plan's stream
  (pretraining, refinement) or the packed SFT set, every check made before any model exists; the
  embedded demo corpus when the config names no data;
* ``loader``  - ``DataLoader`` (what the loop, the trainer and the callbacks read: micro-batches
  per optimizer step, epochs, the data cursor) and its two kinds, ``PretrainLoader`` over the
  stream and ``SFTLoader`` over packed windows.

Training imports the data package through these names only (``tests/test_run.py``), and the
config's ``data:`` section from ``ds_trhash.data.config``. Beside the two above, the few other
things training asks of the data: the errors and figures of the stream it reports
(``StoreUnavailable``, ``DataFigures``), the held-out batches evaluation reads (``SFTBatches``),
where the shard cache lives and how big it may grow (``cache_dir_of``, ``cache_bytes_from``: the
disk check), the plan's token-pack boundaries (the checkpoint plan) and the refinement plan's
checks against pretraining's (the stage guard). Imports the other rooms of ``data``.
"""
from ds_trhash.data.plans.budget import pack_boundaries
from ds_trhash.data.plans.plan import unique_core_fingerprint, validate_refinement
from ds_trhash.data.sft.dataset import SFTBatches
from ds_trhash.data.stage.loader import DataLoader, MicroBatches, PretrainLoader, SFTLoader, StreamRecipe
from ds_trhash.data.stage.opening import StageData, StageRequest, embedded_root, open_stage_data
from ds_trhash.data.stream.cache import cache_bytes_from, cache_dir_of
from ds_trhash.data.stream.delivery import DataFigures
from ds_trhash.data.stream.store import StoreUnavailable

__all__ = ["DataFigures", "DataLoader", "MicroBatches", "PretrainLoader", "SFTBatches", "SFTLoader", "StageData",
           "StageRequest", "StoreUnavailable", "StreamRecipe", "cache_bytes_from", "cache_dir_of", "embedded_root",
           "open_stage_data", "pack_boundaries", "unique_core_fingerprint", "validate_refinement"]
