"""What a rank reads, step after step: the stream of its micro-batches.

* ``reader``      - ``ReplayReader``: the plan's rows (``order``) read through a working set, with
  the prefetch that follows the plan in time;
* ``working_set`` - the shards a reader reads now and next, held and mapped once;
* ``steps``       - ``RankStream`` / ``open_stream``: one rank's micro-batches, a step or two ahead
  (``DataFigures``: where its time went);
* ``assembly``    - those steps assembled on one background thread;
* ``exchange/``   - on several nodes reading the Hub, the rows travel between nodes instead.

Imports ``order``, ``cache``, ``store`` and the stream's shared names.
"""
from ds_trhash.data.stream.delivery.assembly import THREAD_NAME
from ds_trhash.data.stream.delivery.exchange import (CHUNK_ROWS, NodeLayoutError, PeerReadError, PeerStoreUnavailable,
                                                     Readiness, RowExchange, agreed_node_count)
from ds_trhash.data.stream.delivery.reader import DEFAULT_PREFETCH_S, ReaderError, ReplayReader
from ds_trhash.data.stream.delivery.steps import DataFigures, NodeShare, RankStream, open_stream

__all__ = ["CHUNK_ROWS", "DEFAULT_PREFETCH_S", "THREAD_NAME", "DataFigures", "NodeLayoutError", "NodeShare",
           "PeerReadError", "PeerStoreUnavailable", "RankStream", "Readiness", "ReaderError", "ReplayReader",
           "RowExchange", "agreed_node_count", "open_stream"]
