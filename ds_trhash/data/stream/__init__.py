"""What a training step reads through: the store a corpus lives in (local or Hub), the node's bounded
shard cache, and the reader that cuts a plan's global row order into per-rank batches. ``opening``
answers a launch's one question (can this plan be read from this store). Imports ``formats`` and ``plans``.
"""
