"""Command line of `deepspeed launch/train.py`: arguments, distributed start, the one handler of its errors."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence

import torch.distributed as dist
import torch

from ds_trhash import checkpoints as ckpt
from ds_trhash.checkpoints import run_lock
from ds_trhash.data.config import DataSection
from ds_trhash.data.stage import StoreUnavailable
from ds_trhash.errors import UserError
from ds_trhash.network import describe_network
from ds_trhash.ranks import barrier
from ds_trhash.training import config as tcfg
from ds_trhash.training import liveness
from ds_trhash.training.callbacks import Callback
from ds_trhash.training.callbacks.base import TrainState
from ds_trhash.training.callbacks.stop import EXIT_REQUEUE
from ds_trhash.training.determinism import use_deterministic_kernels
from ds_trhash.training.engine import DEFAULT_GROUP_MINUTES, init_distributed
from ds_trhash.training.failures import disk_failure, peer_lost
from ds_trhash.training.memory.record import exit_event
from ds_trhash.training.memory.step import OutOfMemoryExit
from ds_trhash.training.preparation.checks import LaunchCheckError
from ds_trhash.training.preparation.output import OutputSide, check_output_paths, check_output_side
from ds_trhash.training.preparation.request import LaunchRequest
from ds_trhash.training.signals import EXIT_OUT_OF_MEMORY, StopRequests
from ds_trhash.training.trainer import run_stage

log = logging.getLogger("ds_trhash")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch/train.py",
        description="Train one TR-HASH stage (pretraining, refinement or SFT) with DeepSpeed.",
    )
    p.add_argument("--config", required=True, help="YAML stage config, e.g. ds_configs/tiny/pretrain.yaml")
    p.add_argument("--output-dir", help="override output_dir")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set batch.micro_batch=8 (repeatable)")
    p.add_argument("--max-steps", type=int, help="a bounded run: at most this many optimizer steps")
    p.add_argument("--init-checkpoint", "--checkpoint", dest="init_checkpoint", metavar="DIR",
                   help="weights-only initialisation: fresh optimizer, scheduler and step; DIR is a "
                        "checkpoint, an export (a finished stage's RUN/final), or a run's --output-dir (its "
                        "final complete checkpoint)")
    p.add_argument("--resume", metavar="auto|DIR",
                   help="exact continuation from DIR, or 'auto' for the newest complete checkpoint "
                        "in the output directory (also RESUME=auto)")
    p.add_argument("--allow-fresh-over-damaged", action="store_true",
                   help="with --resume auto: when checkpoints exist but none verifies, set them aside "
                        "(renamed, never deleted) and start fresh instead of refusing")
    p.add_argument("--fork", action="store_true",
                   help="--resume DIR of another run into this --output-dir: continue it here as a new run")
    p.add_argument("--reshard", action="store_true",
                   help="allow --resume onto a different world size (universal checkpoint conversion)")
    p.add_argument("--source-stage", choices=["refinement", "supervised-finetuning"],
                   help="SFT launches: the stage of the --init-checkpoint")
    p.add_argument("--full-parameter", action="store_true", help="SFT: update every parameter (no LoRA)")
    p.add_argument("--lora-rank", type=int, help="SFT: LoRA mode with this rank (without --full-parameter)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def launch_request(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> LaunchRequest:
    """The parsed command line and the variables a launch honours (``RESUME``, ``TARGET_TOKENS``),
    read here once: nothing below the entry point sees ``args`` or reads them from the environment.
    Refuses flags that contradict each other (``launch_overrides``)."""
    return LaunchRequest(
        config=args.config, overrides=tuple(launch_overrides(args)), resume_flag=args.resume or None,
        resume_env=environ.get("RESUME") or None, init_checkpoint=args.init_checkpoint,
        allow_fresh_over_damaged=args.allow_fresh_over_damaged, fork=args.fork, reshard=args.reshard,
        target_tokens=environ.get("TARGET_TOKENS") or None)


def launch_config(request: LaunchRequest) -> tcfg.TrainConfig:
    """The stage config the request names, with its overrides, checked against this machine."""
    cfg = tcfg.load_config(request.config, list(request.overrides))
    tcfg.check_device(cfg, torch.cuda.is_available())
    return cfg


def config_from_args(args: argparse.Namespace) -> tcfg.TrainConfig:
    return launch_config(launch_request(args))


def launch_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides the command line makes: its ``--set`` values, then what the flags
    (--output-dir, --max-steps, --source-stage, the SFT mode) set, each checked here."""
    overrides = list(args.set)
    if args.output_dir is not None:
        if not args.output_dir.strip():
            raise tcfg.ConfigError("--output-dir", "output_dir", "is empty; pass the directory the run writes to")
        overrides.append(f"output_dir={args.output_dir}")
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise tcfg.ConfigError("--max-steps", "training.max_steps", f"must be ≥ 1, got {args.max_steps}")
        overrides.append(f"training.max_steps={args.max_steps}")
    if args.source_stage:
        overrides.append(f"source_stage={args.source_stage}")
    if args.full_parameter and args.lora_rank is not None:
        raise tcfg.ConfigError("--lora-rank", "lora.rank", "LoRA mode excludes --full-parameter; pass one of them")
    if args.full_parameter:
        overrides.append("lora.enabled=false")
    if args.lora_rank is not None:
        overrides += ["lora.enabled=true", f"lora.rank={args.lora_rank}"]
    return overrides


def out_of_memory_peer(event: dict, rank: int) -> int:
    """A rank whose collective failed because another rank ran out of device memory and stopped
    every rank (``micro_batch.json``'s last event, written by this launch): its line names that
    rank, and it exits as that rank did. Where liveness runs, the failing rank's abort reaches
    every rank first (``launch``); this file is the notice when liveness is off."""
    rank_line(f"error: rank {rank}: rank {event['rank']} ran out of device memory at step {event['step']} where the "
              f"ranks cannot retry in place; every rank stops, exit {EXIT_OUT_OF_MEMORY}; micro-batch {event['to']} "
              f"(grad_accum {event['grad_accum']}) is recorded and --resume auto continues from the last complete "
              "checkpoint at that size")
    return EXIT_OUT_OF_MEMORY


def port_in_use(addr: str, port: int) -> bool:
    """Whether another process listens on ``addr:port`` (binding it fails with EADDRINUSE)."""
    with socket.socket() as probe:
        try:
            probe.bind((addr, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


GROUP_MARGIN_MINUTES = 10.0


def group_timeout_minutes(data: DataSection) -> float:
    """The default group's timeout: 30 minutes, or one read's budget (``data.hub_wait_minutes``)
    and ten minutes more when that is longer. No rank waits in it for a read (the stop agreement
    polls instead), but a rank that stops on its read's failure ends its budget no later than
    that; the margin keeps its peers' collectives from timing out first."""
    return max(DEFAULT_GROUP_MINUTES, data.hub_wait_minutes + GROUP_MARGIN_MINUTES)


def start_process_group(timeout_minutes: float = DEFAULT_GROUP_MINUTES) -> tuple[int, int]:
    """``init_distributed``; a master port another process holds (two launches on one host with
    the same ``--master_port``) is refused with the port and how to choose another. The first rank
    of every node but the master's says which interface gloo uses there (rank 0's summary says
    the master node's)."""
    try:
        rank, world = init_distributed(timeout_minutes)
    except dist.DistNetworkError:
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "")
        if port.isdigit() and port_in_use(addr, int(port)):
            raise LaunchCheckError(
                f"the master port {port} on {addr} is already in use (another launch on this host?); choose a "
                f"free one with `deepspeed --master_port PORT ...` (torchrun: --master-port), "
                f"or stop the process that holds it") from None
        raise
    if rank != 0 and os.environ.get("LOCAL_RANK") == "0":
        rank_line(f"rank {rank}: {describe_network(torch.cuda.is_available())}")
    return rank, world


def launch_rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size as the launcher announced them (before
    torch.distributed starts): every rank reads the same config, so one of them reports."""
    def env_int(name: str) -> int:
        try:
            return int(os.environ.get(name, ""))
        except ValueError:
            return 0 if name == "RANK" else 1
    return env_int("RANK"), max(1, env_int("WORLD_SIZE"))


def _refused(e: UserError, rank: int, output_dir: str | None) -> int:
    """An expected refusal: its message (rank 0), or, for an error one rank met mid-run
    (``UserError.per_rank``: its read failed, or another node's read of its rows), one line from
    each rank that met it; after a Hub that stayed away, with what to run next."""
    if isinstance(e, StoreUnavailable):
        rank_line(f"error: rank {rank}: {e}; {_relaunch_advice(output_dir)}")
    elif e.per_rank:
        rank_line(f"error: rank {rank}: {e}")
    elif rank == 0:  # in one write, flushed: the launcher may terminate this process right after
        rank_line(f"error: {e}")
    return e.exit_code


def _relaunch_advice(output_dir: str | None) -> str:
    """After the Hub stayed away longer than data.hub_wait_minutes: what is kept, what to run."""
    found = [c for c in ckpt.list_checkpoints(output_dir) if c.has_manifest] if output_dir is not None else []
    if not found:
        return "no checkpoint was written: run the same command again once the Hub answers"
    return (f"training stopped; the last complete checkpoint ({found[-1].path.name}) is kept, and the same command "
            "with --resume auto continues from it once the Hub answers")


def rank_line(text: str) -> None:
    """One line on stderr in a single write: every rank shares the launcher's pipe, and print()
    writes the text and its newline separately, so two ranks' lines could run together."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _stopped(state: TrainState, rank: int, world: int) -> int:
    """One line per rank, so the operator (and the tests) see every rank stop at the same step (or
    before this launch's first, when nothing was trained); the exit status: EXIT_REQUEUE after the
    scheduler's time-limit warning, else 0."""
    code = EXIT_REQUEUE if state.stop_requeue else 0
    done = ("before its first step: nothing was trained and no checkpoint was written" if state.steps_timed == 0
            else "after a complete checkpoint")
    rank_line(f"rank {rank}/{world}: stopped at step {state.step} of {state.total_steps} {done} ({state.stop_reason}); "
              f"exiting {code}" + (" (requeue me: --resume auto continues)" if code else ""))
    return code


def lock_and_decide(cfg: tcfg.TrainConfig, request: LaunchRequest, rank: int,
                    world: int) -> tuple[run_lock.RunLock | None, OutputSide | None]:
    """One launch per output directory (checkpoints/run_lock.py): rank 0 takes the lock before
    anything is decided about the directory: (rank 0's lock, the decision). Alone, it decides
    fresh start, resume from which checkpoint, or refusal right here, before any process group
    exists. With other ranks, every rank decides once the process group has started (None here),
    which waits for rank 0, so under its lock too, and all refuse at once: a rank left waiting in
    the rendezvous for a rank 0 that refused alone would hang until the launcher killed it. A wrong
    --output-dir path is refused before the lock creates the directory."""
    check_output_paths(cfg, request)
    if rank != 0:
        run_lock.check_peer(cfg.output_dir)
        return None, None
    lock = run_lock.acquire(cfg.output_dir, log=log.info)
    if world > 1:
        return lock, None
    try:
        return lock, check_output_side(cfg, request, rank)
    except BaseException:
        lock.release()  # refused (or failed) before writing: the directory as it was found
        raise


def _set_up_logging(rank: int) -> None:
    """INFO on rank 0, warnings elsewhere; the Hub client's HTTP library logs every request at INFO
    (404s of probes included): a streamed launch reports its shards through the cache's counters."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "httpx2", "httpcore", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None, parts: Sequence[type[Callback]] | None = None,
         requests: StopRequests | None = None) -> int:
    """Run one launch (``launch``); then this rank's liveness ends, telling the peers how it ended
    (a rank that leaves in order is never taken for a lost one)."""
    code = 1  # a traceback (a bug) leaves with it
    try:
        code = launch(argv, parts, requests)
        return code
    finally:
        liveness.stop(code)


def _peer_lost_code(rank: int, output_dir: str | None, started_at: float) -> int:
    """A collective failed because a peer went away: liveness's verdict names it (its line is
    said, ``lost_peer.json`` written, and the process ends with its code, normally before this
    returns; a peer's abort, such as an out-of-memory step's, is a verdict too). Without one
    (liveness off, or the peer left with its own error): a peer's out-of-memory exit recorded in
    ``micro_batch.json`` by this launch, else one line and exit 1."""
    verdict = liveness.current().wait_for_verdict()
    if verdict is not None:
        return verdict.code
    if output_dir is not None and (oom := exit_event(output_dir, since=started_at)):
        return out_of_memory_peer(oom, rank)
    rank_line(f"error: rank {rank}: lost contact with another rank, which stopped (its message above says "
              "why); exiting")
    return 1


def launch(argv: list[str] | None = None, parts: Sequence[type[Callback]] | None = None,
           requests: StopRequests | None = None) -> int:
    """Run one launch. ``parts``: the callback classes in call order (``ds_trhash.run`` composes
    them with evaluation). ``requests``: the stop-signal recorder ``launch/train.py`` installed
    before it imported torch; None (a launch inside a caller's process) records nothing and leaves
    the caller's handlers alone.

    The one place a launch's refusal becomes output: a ``UserError`` (raised by the config, the
    data, the checkpoints, any part) prints ``error: <message>`` on rank 0 and exits with its
    code (2). A disk that fails under the run or a rank that is lost ends it with one line per
    rank and exit 1, unless liveness named the lost rank (exit ``EXIT_PEER_LOST``, 76, or a peer's
    abort code). A stop on the scheduler's time-limit warning (SIGUSR1) exits ``EXIT_REQUEUE``
    (75) on every rank, after its checkpoint. Anything else is a bug and keeps its traceback."""
    args = build_arg_parser().parse_args(argv)
    started_at = time.time()
    rank, world = launch_rank_and_world()
    _set_up_logging(rank)
    output_dir = lock = None
    started = False  # whether this launch made the process group (only then does it tear it down)
    try:
        request = launch_request(args)
        cfg = launch_config(request)
        tcfg.check_paths(cfg)  # every path the config names, before anything starts (preflight: its paths line)
        output_dir = cfg.output_dir
        tcfg.batch_layout(cfg, world)  # a global batch this world cannot split: refused now
        lock, checked = lock_and_decide(cfg, request, rank, world)
        use_deterministic_kernels(cfg.training.deterministic)  # before CUDA's first matmul (the self-check)
        started = not dist.is_initialized()  # an in-process caller's group is left to its owner
        rank, world = start_process_group(group_timeout_minutes(cfg.data))
        liveness.start(cfg, rank, world)  # the peers' addresses through the group's store, once
        for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        if checked is None:
            checked = check_output_side(cfg, request, rank)
        state = run_stage(cfg, request, rank, world, parts, checked, on_first_write=lock.keep if lock else None,
                          requests=requests)
        barrier()  # no rank tears gloo/NCCL down while a peer still has traffic in flight
        if state.stop_requested:
            return _stopped(state, rank, world)
    except OutOfMemoryExit as e:
        if world > 1:  # the peers may wait inside a collective (NCCL): told through liveness, every rank exits 77
            liveness.abort(str(e), e.exit_code)
        return _refused(e, rank, output_dir)
    except UserError as e:
        return _refused(e, rank, output_dir)
    except Exception as e:
        cause = disk_failure(e, output_dir) if output_dir is not None else None
        if cause is not None:  # the disk: read-only, full, gone (one line per rank that hit it)
            rank_line(f"error: rank {rank}: {cause}; training stopped, the last complete checkpoint is kept")
            return 1
        if peer_lost(e, world):
            return _peer_lost_code(rank, output_dir, started_at)
        raise
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:  # kept once the launch wrote; a refused launch changes nothing
            lock.release()
    return 0
