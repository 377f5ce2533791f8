"""micro_batch.json: every change appended and the size in force replaced, durably; what a rank
whose collective failed reads: only an exit written by this launch."""
import json
import time

from ds_trhash.training.memory.record import MICRO_BATCH_FILE, exit_event, read_record, record_change


def test_each_change_is_kept_and_the_last_size_holds(tmp_path):
    assert read_record(tmp_path) is None
    record_change(tmp_path, step=3, rank=1, old=8, new=4, grad_accum=2, how="in place")
    record_change(tmp_path, step=9, rank=0, old=4, new=2, grad_accum=4, how="exit")
    record = json.loads((tmp_path / MICRO_BATCH_FILE).read_text())
    assert (record["micro_batch"], record["grad_accum"]) == (2, 4)
    assert [(e["step"], e["rank"], e["from"], e["to"], e["how"]) for e in record["events"]] == [
        (3, 1, 8, 4, "in place"), (9, 0, 4, 2, "exit")]


def test_only_an_exit_of_this_launch_is_reported_to_the_peers(tmp_path):
    started = time.time() - 1
    record_change(tmp_path, step=3, rank=1, old=8, new=4, grad_accum=2, how="in place")
    assert exit_event(tmp_path, since=started) is None  # a retry in place ends no rank
    record_change(tmp_path, step=5, rank=1, old=4, new=2, grad_accum=4, how="exit")
    assert exit_event(tmp_path, since=started)["step"] == 5
    assert exit_event(tmp_path, since=time.time() + 60) is None  # an earlier launch's exit
    (tmp_path / MICRO_BATCH_FILE).write_text("{not json")
    assert read_record(tmp_path) is None and exit_event(tmp_path, since=started) is None
