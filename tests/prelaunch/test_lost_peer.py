"""``prelaunch.lost_peer``: the host a lost-peer record blames, checked before the SLURM script
passes it to `scontrol update ExcNodeList=` (through the script: test_slurm_lost_node.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ds_trhash.prelaunch.lost_peer import RECORD_MAX, LostPeerRecordError, blamed_host

HOSTS = ["gpu-a01", "gpu-a02.cluster.example"]


def _write(tmp_path, data) -> object:
    path = tmp_path / "lost_peer.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_the_blamed_host_and_one_plain_line_of_what_happened(tmp_path):
    record = _write(tmp_path, {"rank": 5, "node": 1, "host": "gpu-a02.cluster.example", "step": 120,
                               "phase": "all-reduce\n\x1b[31m", "reason": "silent\tpeer", "silent_s": 90,
                               "detected_by_rank": 0, "time": "t"})
    assert blamed_host(record, HOSTS) == ("gpu-a02.cluster.example", "rank 5 at step 120 (all-reduce [31m; silent peer; "
                                                                      "silent 90 s)")


@pytest.mark.parametrize("host", ["gpu-a[01-02]", "gpu-a01,gpu-a02", "gpu-a01 ", "-gpu", "", "a" * 300, None, 3,
                                  "gpu-a01;reboot", "gpu-a03"])
def test_a_host_that_is_not_one_of_the_attempts_plain_host_names_is_refused(tmp_path, host):
    with pytest.raises(LostPeerRecordError, match="host"):
        blamed_host(_write(tmp_path, {"host": host}), HOSTS)


def test_what_is_not_a_small_plain_json_object_is_refused(tmp_path):
    for text, why in (("[1]", "JSON list"), ("{", "cannot be read as JSON"), ("x" * (RECORD_MAX + 1), "over 65536 bytes")):
        with pytest.raises(LostPeerRecordError, match=why):
            blamed_host(_write(tmp_path, text), HOSTS)
    link = tmp_path / "link.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(LostPeerRecordError, match="not a plain file"):
        blamed_host(link, HOSTS)


def test_the_command_prints_host_tab_account_or_the_reason_and_exit_1(tmp_path):
    good = _write(tmp_path, {"host": "gpu-a01", "rank": 2})
    run = subprocess.run([sys.executable, "-m", "ds_trhash.prelaunch.lost_peer", str(good), *HOSTS],
                         capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (0, "gpu-a01\trank 2\n")
    bad = _write(tmp_path, {"host": "gpu-a09"})
    run = subprocess.run([sys.executable, "-m", "ds_trhash.prelaunch.lost_peer", str(bad), *HOSTS],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "'gpu-a09' is not one of this attempt's hosts" in run.stderr and not run.stdout
