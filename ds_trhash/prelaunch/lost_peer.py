"""The host a lost-peer record blames, read for the SLURM job script.

When a rank is lost (a silent or stuck peer), every rank still running exits EXIT_PEER_LOST (76)
and the rank that saw it first writes ``<output dir>/lost_peer.json`` (its keys: rank, node, host,
step, phase, silent_s, reason, detected_by_rank, time). The job script written by ``ds-trhash ops
slurm`` then requeues the job with that host added to the job's excluded nodes (``scontrol update
JobId=... ExcNodeList=...``). What it passes to scontrol comes from a file any rank (or a person)
could have written, so it is checked here first: a JSON object whose ``host`` is one plain host
name and one of the hosts of the attempt that failed. Anything else is named, and the script
requeues without an exclusion.

``python -m ds_trhash.prelaunch.lost_peer RECORD HOST...`` prints ``HOST<TAB>what happened`` and
exits 0, or prints why the record cannot be used on stderr and exits 1. Standard library only,
and of ours only ``errors`` (its refusal is a ``UserError`` like every other): the batch shell runs
it once per lost rank, on the job's first node.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from ds_trhash.errors import UserError

RECORD_FILE = "lost_peer.json"
# one host name: dot-separated labels of letters, digits, '-' and '_' (SLURM node names), nothing
# that scontrol would read as a host-list expression ('[', ',') or the shell as anything at all
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
HOST_NAME_MAX = 253
RECORD_MAX = 65536  # a record is a few hundred bytes
WHAT_MAX = 200  # the account printed in the job output


class LostPeerRecordError(UserError, ValueError):
    """A lost-peer record the job script cannot act on (the message says why)."""


def blamed_host(record: Path, hosts: list[str]) -> tuple[str, str]:
    """(host, a short account of the loss) from ``record``, whose host must be one of ``hosts``."""
    if record.is_symlink() or not record.is_file():
        raise LostPeerRecordError(f"{record} is not a plain file")
    try:
        with record.open("rb") as f:
            raw = f.read(RECORD_MAX + 1)
        if len(raw) > RECORD_MAX:
            raise ValueError(f"over {RECORD_MAX} bytes")
        data = json.loads(raw.decode())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LostPeerRecordError(f"{record} cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise LostPeerRecordError(f"{record} holds a JSON {type(data).__name__}, not the record's object")
    host = data.get("host")
    if not isinstance(host, str) or len(host) > HOST_NAME_MAX or not HOST_NAME.fullmatch(host):
        raise LostPeerRecordError(f"{record}: \"host\" is {host!r}, not one plain host name")
    if host not in hosts:
        raise LostPeerRecordError(f"{record}: host {host!r} is not one of this attempt's hosts ({', '.join(hosts)})")
    what = [f"rank {data['rank']}" if isinstance(data.get("rank"), int) else "a rank"]
    if isinstance(data.get("step"), int):
        what.append(f"at step {data['step']}")
    details = [str(data[key]) for key in ("phase", "reason") if isinstance(data.get(key), str) and data[key]]
    if isinstance(data.get("silent_s"), (int, float)):
        details.append(f"silent {data['silent_s']:.0f} s")
    text = " ".join(what) + (f" ({'; '.join(details)})" if details else "")
    text = "".join(c for c in " ".join(text.split()) if c.isprintable())  # one plain line, whatever it held
    return host, text[:WHAT_MAX]


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m ds_trhash.prelaunch.lost_peer RECORD HOST...", file=sys.stderr)
        return 2
    try:
        host, what = blamed_host(Path(argv[0]), argv[1:])
    except LostPeerRecordError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{host}\t{what}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
