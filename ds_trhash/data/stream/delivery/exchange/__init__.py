"""Rows across nodes: on several nodes reading a Hub store each shard is filled by one owner node,
and the rows the other nodes train on travel to them over gloo, chunk by chunk.

* ``rows``  - ``RowExchange``: a rank's micro-batches from the rows of its exchange group (the
  reads, the sends, readiness for the stop agreement, close);
* ``chunk`` - one chunk's exchange: the bytes on the wire (a status before each member's part)
  and the errors a failed chunk raises on the other nodes (``PeerReadError``; on one node, without
  an exchange, the error the other ranks raise for a rank's failed read: ``rank_read_error``);
* ``nodes`` - the node count, agreed by every rank (``NodeLayoutError``), and each shard's owner.

Imports the stream's ``reader``, ``order``, ``deadline`` and ``store``; never training.
"""
from ds_trhash.data.stream.delivery.exchange.chunk import (OK, PeerReadError, PeerStoreUnavailable, rank_read_error,
                                                           status_of)
from ds_trhash.data.stream.delivery.exchange.nodes import NodeLayoutError, agreed_node_count, node_count, owners
from ds_trhash.data.stream.delivery.exchange.rows import CHUNK_ROWS, Readiness, RowExchange

__all__ = ["CHUNK_ROWS", "OK", "NodeLayoutError", "PeerReadError", "PeerStoreUnavailable", "Readiness", "RowExchange",
           "agreed_node_count", "node_count", "owners", "rank_read_error", "status_of"]
