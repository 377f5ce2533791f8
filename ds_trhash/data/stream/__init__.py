"""What a training step reads through, in rooms by job:

* ``store/``    - where a corpus lives (a local directory or a Hub dataset repository);
* ``corpus/``   - the launch's one question (can this plan be read from this store) and the pinned corpus;
* ``cache/``    - the node's bounded shard cache and its prefetch process;
* ``order/``    - the plan's global row order, as arithmetic;
* ``delivery/`` - one rank's micro-batches, step after step (reader, working set, background
  assembly, the row exchange between nodes).

Beside them, the names they share: ``types`` (``Key``), ``deadline`` (one deadline per read) and
``mapped_shard`` (a shard's tokens mapped once). Callers import a room's public names
(``from ds_trhash.data.stream.cache import ShardCache``). Imports ``formats`` and ``plans``.
"""
