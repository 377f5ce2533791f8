"""A verdict's line and its lost_peer.json record (written atomically; the first of a launch kept)."""
from __future__ import annotations

import json

from ds_trhash.training.liveness.exit import LOST_PEER_FILE, describe, write_record
from ds_trhash.training.liveness.verdict import ABORTED, SILENT, STUCK, Verdict


def lost(**over) -> Verdict:
    return Verdict(**{"rank": 1, "node": 1, "host": "gpu-b07", "step": 20, "phase": "forward_backward",
                      "silent_s": 31.4, "reason": SILENT, "detected_by_rank": 0, **over})


def test_the_lines_name_the_rank_its_node_host_step_and_what_happened():
    assert describe(lost(), 0, 2) == (
        "error: rank 0/2: lost rank 1 (node 1, host gpu-b07): silent for 31 s, last heard at step 20 "
        "(forward_backward); exiting 76 without waiting (the last complete checkpoint is kept: the same command "
        "with --resume auto continues once the node is back)")
    assert "rank 1 (node 1, host gpu-b07) is stuck in eval at step 20 for 400 s (limit 300 s)" in describe(
        lost(reason=STUCK, phase="eval", silent_s=400.0, detail="limit 300 s"), 0, 2)
    assert "this rank, rank 1 (node 1, host gpu-b07), was frozen or cut off for 45 s" in describe(
        lost(silent_s=45.0, itself=True, detected_by_rank=1), 1, 2)
    assert describe(lost(reason=ABORTED, code=77, detail="out of memory"), 0, 2) == (
        "error: rank 0/2: rank 1 (node 1, host gpu-b07) aborted the run: out of memory; exiting 77")
    assert describe(lost(reason=ABORTED, code=77, detail="out of memory"), 1, 2) == (
        "error: rank 1/2: aborting every rank: out of memory; exiting 77")


def test_the_record_holds_every_field_and_the_first_verdict_of_a_launch_is_kept(tmp_path):
    (tmp_path / LOST_PEER_FILE).write_text(json.dumps({"rank": 0, "launch": "an-earlier-launch"}))
    write_record(tmp_path, lost(), "launch-2", "the line")
    doc = json.loads((tmp_path / LOST_PEER_FILE).read_text())
    assert {k: doc[k] for k in ("rank", "node", "host", "step", "phase", "silent_s", "reason", "detected_by_rank",
                                "code", "launch")} == {
        "rank": 1, "node": 1, "host": "gpu-b07", "step": 20, "phase": "forward_backward", "silent_s": 31.4,
        "reason": "silent", "detected_by_rank": 0, "code": 76, "launch": "launch-2"}
    assert doc["time"].endswith("Z") and doc["message"] == "the line"
    write_record(tmp_path, lost(rank=0, detected_by_rank=1), "launch-2", "a later line")  # the same launch
    assert json.loads((tmp_path / LOST_PEER_FILE).read_text())["rank"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [LOST_PEER_FILE]  # no temporary left
