"""One chunk's exchange between the members of a group (``rows``): who sends which rows to
whom, the bytes on the wire (an 8-byte status before each member's part), and the errors a
failed chunk raises on the ranks that did not fail themselves."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ds_trhash.data.stream.order import RowRef
from ds_trhash.data.stream.store import StoreUnavailable
from ds_trhash.errors import UserError

HEADER = 8  # bytes: an int64 status before each member's rows
OK, STORE_GONE, FAILED, STOPPED = 0, 1, 2, 3  # STOPPED: sent by a rank that closes (every rank stops there)


class PeerReadError(UserError, RuntimeError):
    """Another node could not read the rows it owns for this rank, or, on one node, another rank
    could not read its own rows of the step (its own error is in its log)."""

    per_rank = True


class PeerStoreUnavailable(PeerReadError, StoreUnavailable):
    """As ``PeerReadError``, because the store stayed away longer than that node's wait budget."""


def status_of(error: Optional[BaseException]) -> int:
    """The status a failed read sends in place of its rows."""
    return STORE_GONE if isinstance(error, StoreUnavailable) else FAILED


def peer_error(node: int, status: int, steps: range) -> PeerReadError:
    """What a rank raises for node ``node``'s failed read of steps ``steps``: a
    ``StoreUnavailable`` when the store was the cause, so that its launch says how to relaunch."""
    kind = PeerStoreUnavailable if status == STORE_GONE else PeerReadError
    return kind(f"node {node} could not read the rows it owns for steps {steps.start}-{steps.stop - 1} "
                "(its own error is in its log)")


def rank_read_error(rank: int, status: int, step: int) -> PeerReadError:
    """What a rank raises for rank ``rank``'s failed read of its own rows of ``step`` (ranks that
    exchange no rows: each reads its own), a ``StoreUnavailable`` when the store was the cause."""
    kind = PeerStoreUnavailable if status == STORE_GONE else PeerReadError
    return kind(f"rank {rank} could not read its rows for step {step} (its own error is in its log)")


@dataclass
class Chunk:
    """One chunk's exchange: what this rank sends each member (the positions of the rows, then the
    bytes: an 8-byte status before each member's part), what it receives from each, and where
    those rows go among its own."""
    refs: list[RowRef]  # the chunk's global rows
    sends: list[np.ndarray]  # per member: positions in ``refs`` of its rows this node owns, its order
    send_bytes: list[int]
    recv_bytes: list[int]
    places: list[np.ndarray]  # per node: where the rows it sends go among this rank's
    rows: int  # this rank's rows in the chunk
    send: np.ndarray = field(init=False)
    error: Optional[BaseException] = None
    recv: Optional[torch.Tensor] = None
    work: Optional[dist.Work] = None  # the exchange in flight

    def __post_init__(self) -> None:
        self.send = np.zeros(sum(self.send_bytes), dtype=np.uint8)  # status OK (0) and rows to come

    def pack(self, windows: np.ndarray) -> None:
        """The rows read ([sum of sends, seq_len + 1] uint16, the members' parts in turn) put into
        the send buffer after each part's status."""
        offset, row = 0, 0
        for part, size in zip(self.sends, self.send_bytes):
            self.send[offset + HEADER:offset + size] = windows[row:row + len(part)].reshape(-1).view(np.uint8)
            offset, row = offset + size, row + len(part)

    def fail(self, error: Optional[BaseException], status: Optional[int] = None) -> None:
        """A status instead of rows for every member; ``error`` raised here at the exchange."""
        self.error, offset = error, 0
        status = status_of(error) if status is None else status
        for size in self.send_bytes:
            self.send[offset:offset + HEADER].view(np.int64)[0] = status
            offset += size

    def statuses(self) -> list[int]:
        """Each node's status in what this rank received (the exchange completed)."""
        if self.recv is None:
            raise RuntimeError("statuses read before the exchange received anything")
        recv, offset, found = self.recv.numpy(), 0, list[int]()
        for size in self.recv_bytes:
            found.append(int(recv[offset:offset + HEADER].view(np.int64)[0]))
            offset += size
        return found
