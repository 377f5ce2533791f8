"""Command line of `deepspeed launch/train.py`: arguments, distributed start, user-facing errors."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch.distributed as dist

from ds_trhash import checkpoints as ckpt
from ds_trhash.training import config as tcfg
from ds_trhash.checkpoints.stages import StageError
from ds_trhash.training.callbacks import Callback
from ds_trhash.training.engine import EngineError, init_distributed
from ds_trhash.training.trainer import USER_ERRORS, run_stage

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
                   help="weights-only initialisation: fresh optimizer, scheduler and step")
    p.add_argument("--resume", metavar="auto|DIR",
                   help="exact continuation from DIR, or 'auto' for the newest complete checkpoint "
                        "in the output directory (also RESUME=auto)")
    p.add_argument("--reshard", action="store_true",
                   help="allow --resume onto a different world size (universal checkpoint conversion)")
    p.add_argument("--source-stage", choices=["refinement", "supervised-finetuning"],
                   help="SFT launches: the stage of the --init-checkpoint")
    p.add_argument("--full-parameter", action="store_true", help="SFT: update every parameter (no LoRA)")
    p.add_argument("--lora-rank", type=int, help="SFT: LoRA mode with this rank (without --full-parameter)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> tcfg.TrainConfig:
    overrides = list(args.set)
    if args.output_dir:
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
    return tcfg.load_config(args.config, overrides)


def main(argv: list[str] | None = None, parts: Sequence[type[Callback]] | None = None,
         user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run one launch. ``parts``: the callback classes in call order (``ds_trhash.run`` composes
    them with evaluation); ``user_errors``: further exception types that describe a wrong launch
    (printed as one line, exit 2) from the packages that supplied parts."""
    args = build_arg_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except tcfg.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rank, world = init_distributed()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        run_stage(cfg, args, rank, world, parts)
        if dist.is_initialized() and world > 1:
            dist.barrier()  # no rank tears gloo/NCCL down while a peer still has traffic in flight
    except (tcfg.ConfigError, StageError, EngineError, ckpt.ResumeError, ckpt.CheckpointError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # data-layer errors carry their own types; all are user-facing here
        if isinstance(e, USER_ERRORS + tuple(user_errors)):
            if rank == 0:
                print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
