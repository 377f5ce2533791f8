"""One chunk's bytes on the wire (``exchange.chunk``): each member's part is an 8-byte status then
its rows as stored; a failed read keeps the sizes and sends its status in every header; the
status says whether the store was the cause. What the other ranks raise from a status is tested
through the gloo job in test_rows.py and test_faults.py."""

import numpy as np
import torch

from ds_trhash.data.stream.delivery.exchange.chunk import FAILED, HEADER, OK, STOPPED, STORE_GONE, Chunk, status_of
from ds_trhash.data.stream.store.base import ReadTimedOut, StoreUnavailable

SEQ = 3  # tokens per row: seq_len + 1 = 4 uint16, 8 bytes a row
ROW_BYTES = (SEQ + 1) * 2


def _chunk(rows_per_member):
    sends = [np.arange(n) for n in rows_per_member]
    sizes = [HEADER + n * ROW_BYTES for n in rows_per_member]
    return Chunk(refs=[], sends=sends, send_bytes=sizes, recv_bytes=list(sizes), places=[], rows=0)


def _parts(chunk):
    """Each member's (status, rows) as the receiver reads them from the send buffer."""
    found, offset = [], 0
    for part, size in zip(chunk.sends, chunk.send_bytes):
        status = int(chunk.send[offset:offset + HEADER].view(np.int64)[0])
        rows = chunk.send[offset + HEADER:offset + size].view(np.uint16).reshape(len(part), SEQ + 1)
        found.append((status, rows))
        offset += size
    return found


def test_each_members_rows_follow_its_ok_status_in_the_send_buffer():
    chunk = _chunk([2, 0, 1])  # the second member trains on no row this node owns
    windows = np.arange(3 * (SEQ + 1), dtype=np.uint16).reshape(3, SEQ + 1) + 60000  # above int16
    chunk.pack(windows)
    assert chunk.send.nbytes == 3 * HEADER + 3 * ROW_BYTES
    (s0, r0), (s1, r1), (s2, r2) = _parts(chunk)
    assert (s0, s1, s2) == (OK, OK, OK)
    assert np.array_equal(r0, windows[:2]) and r1.shape == (0, SEQ + 1) and np.array_equal(r2, windows[2:])


def test_a_failed_read_sends_its_status_to_every_member_in_the_same_sizes():
    chunk = _chunk([1, 2])
    error = ReadTimedOut("a/shard-00001.bin within data.hub_wait_minutes")
    chunk.fail(error)
    assert chunk.error is error and chunk.send.nbytes == sum(chunk.send_bytes)
    assert [status for status, _ in _parts(chunk)] == [STORE_GONE, STORE_GONE]
    chunk.fail(None, STOPPED)  # a rank that closes still sends what it owes
    assert chunk.error is None and [status for status, _ in _parts(chunk)] == [STOPPED, STOPPED]


def test_statuses_are_read_back_from_what_each_node_sent():
    chunk = _chunk([1, 1])
    sent = []
    for status in (OK, FAILED):
        part = np.zeros(HEADER + ROW_BYTES, dtype=np.uint8)
        part[:HEADER].view(np.int64)[0] = status
        sent.append(part)
    chunk.recv = torch.from_numpy(np.concatenate(sent))
    assert chunk.statuses() == [OK, FAILED]


def test_the_status_says_whether_the_store_was_the_cause():
    assert status_of(StoreUnavailable("the Hub stayed away")) == STORE_GONE
    assert status_of(ReadTimedOut("a download lock held too long")) == STORE_GONE
    assert status_of(OSError("disk gone")) == FAILED and status_of(ValueError("corrupt")) == FAILED
    assert len({OK, STORE_GONE, FAILED, STOPPED}) == 4 and OK == 0  # a fresh buffer (zeros) reads as OK
