"""Liveness: every rank proves it is alive to the others beside the training collectives, and a
rank lost (killed, frozen, cut off, stuck past its phase's limit) is named by every rank that can
still run, which then ends at once with ``EXIT_PEER_LOST`` (docs/architecture.md, "Liveness").

The public names other parts use:

- ``start(cfg, rank, world)``: right after the process group started (the entry point); the
  rank's ``Liveness`` (``NoLiveness`` when the config leaves it off or the launch has one rank);
- ``current()``: that object; ``current().beacon`` is where the training thread says what it is
  doing (``beacon.at(step, mark, phase)``, ``with beacon.during(PROBE): ...``);
- ``abort(reason, code)``: every rank ends with ``code``, this one and its peers each with one line;
- ``current().publish_refusal()``: why a checkpoint must not be published now (or None);
- the phase names (``phases.PHASES``) and ``LOST_PEER_FILE``.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torch.distributed import distributed_c10d

from ds_trhash.training.liveness.channel import Channel, PeerInfo, exchange, host_name, local_address, node_index
from ds_trhash.training.liveness.exit import LOST_PEER_FILE, end_process, say
from ds_trhash.training.liveness.monitor import Liveness
from ds_trhash.training.liveness.phases import (
    CHECKPOINT, DATA_WAIT, END, EVAL, FIRST_STEP, FORWARD_BACKWARD, OPTIMIZER, PHASES, PROBE, STARTUP, STEP_END,
    Beacon, Limits)
from ds_trhash.training.liveness.verdict import Verdict

if TYPE_CHECKING:
    from ds_trhash.training.config import TrainConfig

# a Hub wait may last data.hub_wait_minutes; the data phase gets this much more (as the group timeout does)
DATA_MARGIN_MINUTES = 10.0


class NoLiveness:
    """Liveness off (one rank, or ``liveness.enabled: false``): the beacon is written and never
    read, nothing is judged, checkpoints are always published, and ``abort`` ends this rank."""

    def __init__(self) -> None:
        self.beacon = Beacon()
        self.verdict = None

    def publish_refusal(self) -> str | None:
        return None

    def wait_for_verdict(self, timeout: float | None = None) -> Verdict | None:
        return None

    def abort(self, reason: str, code: int) -> None:
        rank = os.environ.get("RANK", "0")
        say(f"error: rank {rank}: aborting: {reason}; exiting {code}")
        end_process(code)

    def close(self, code: int = 0) -> None:
        """Nothing to release: no thread, no socket, no peer to say goodbye to."""


_current: Liveness | NoLiveness = NoLiveness()


def current() -> Liveness | NoLiveness:
    """This process's liveness (``NoLiveness`` until ``start`` made one)."""
    return _current


def limits_of(cfg: TrainConfig) -> Limits:
    """The limits of a launch, in seconds, from its ``liveness:`` section (and the data's Hub budget)."""
    live = cfg.liveness
    data_wait = cfg.data.hub_wait_minutes + DATA_MARGIN_MINUTES
    # start-up may wait out a Hub outage too (the corpus's opening, the first shards): never less than the data's wait
    minutes = {STARTUP: max(live.startup_minutes, data_wait), FIRST_STEP: live.first_step_minutes, PROBE: live.probe_minutes,
               CHECKPOINT: live.checkpoint_minutes, END: live.checkpoint_minutes, EVAL: live.eval_minutes,
               DATA_WAIT: data_wait}
    return Limits(interval_s=live.interval_s, silent_s=live.silent_s, stuck_s=60.0 * live.stuck_minutes,
                  by_phase={phase: 60.0 * m for phase, m in minutes.items()})


def start(cfg: TrainConfig, rank: int, world: int) -> Liveness | NoLiveness:
    """This rank's liveness, running, once the process group has started (every rank calls it at
    the same point: the addresses go through the group's store)."""
    global _current
    enabled = cfg.liveness.enabled if cfg.liveness.enabled is not None else world > 1
    if not enabled or world < 2:
        _current = NoLiveness()
        return _current
    channel = Channel(local_address(os.environ.get("MASTER_ADDR", "127.0.0.1")))
    me = PeerInfo(rank, node_index(rank, world), host_name(), channel.address, channel.port)
    peers, token = exchange(distributed_c10d._get_default_store(), me, world)
    channel.token = token
    live = Liveness(channel, me, peers, limits_of(cfg), output_dir=cfg.output_dir, world=world, launch=token)
    _current = live.start()
    return live


def stop(code: int = 0) -> None:
    """The launch ends with ``code``: the peers are told, and liveness is off again."""
    global _current
    _current.close(code)
    _current = NoLiveness()


def abort(reason: str, code: int) -> None:
    """End every rank with ``code`` (e.g. 77, an out-of-memory step): a notice to every peer, one
    line here naming ``reason``, one line on each peer naming this rank; never returns."""
    _current.abort(reason, code)


__all__ = [
    "CHECKPOINT", "DATA_WAIT", "END", "EVAL", "FIRST_STEP", "FORWARD_BACKWARD", "LOST_PEER_FILE", "OPTIMIZER",
    "PHASES", "PROBE", "STARTUP", "STEP_END", "Beacon", "Limits", "Liveness", "NoLiveness", "Verdict", "abort",
    "current", "limits_of", "start", "stop",
]
