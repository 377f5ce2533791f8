"""The channel: addresses, the one exchange through the store, and datagrams of this launch only."""
from __future__ import annotations

import threading

from torch.distributed import TCPStore

from ds_trhash.deepspeed_command import free_port
from ds_trhash.training.liveness.channel import Channel, PeerInfo, exchange, host_name, local_address, node_index


def test_the_address_is_that_of_the_route_to_the_master_and_names_come_from_the_scheduler():
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert local_address("localhost") in ("127.0.0.1", "::1")
    assert host_name({"SLURMD_NODENAME": "gpu-b07"}) == "gpu-b07"
    assert host_name({}) != ""
    assert node_index(5, 8, {"CROSS_RANK": "1"}) == 1
    assert node_index(5, 8, {"LOCAL_SIZE": "4"}) == 1 and node_index(3, 8, {"LOCAL_SIZE": "4"}) == 0


def test_the_ranks_learn_each_other_once_through_the_store():
    port = free_port()
    stores = [TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False), None]
    stores[1] = TCPStore("127.0.0.1", port, 2, False)
    me = [PeerInfo(r, r, f"host{r}", "127.0.0.1", 4000 + r) for r in range(2)]
    found: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda r=r: found.__setitem__(r, exchange(stores[r], me[r], 2))) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert found[0][0] == [me[1]] and found[1][0] == [me[0]]
    assert found[0][1] == found[1][1] and len(found[0][1]) == 16  # one token, drawn by rank 0


def test_only_datagrams_of_this_launch_are_taken():
    ours, other, receiver = Channel("127.0.0.1", "ours"), Channel("127.0.0.1", "theirs"), Channel("127.0.0.1", "ours")
    try:
        target = [PeerInfo(1, 0, "h", "127.0.0.1", receiver.port)]
        ours.send({"k": "hb", "r": 0}, target)
        other.send({"k": "hb", "r": 5}, target)
        ours.sock.sendto(b"not json", ("127.0.0.1", receiver.port))
        got = receiver.receive(0.5)
        assert [(m["k"], m["r"]) for m in got] == [("hb", 0)]
        ours.send({"k": "hb", "r": 0}, [PeerInfo(2, 1, "gone", "127.0.0.1", 9)])  # nobody there: no error
        assert receiver.receive(0.05) == []
    finally:
        for c in (ours, other, receiver):
            c.close()
