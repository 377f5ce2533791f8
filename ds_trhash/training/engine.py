"""Wrap a model in a DeepSpeed engine that owns the optimizer, scheduler, ZeRO and precision.

The optimizer and scheduler are built here as client objects (torch AdamW and the project's
single schedule) and handed to ``deepspeed.initialize``, so every stage uses exactly the same
formula and the scheduler state is part of the DeepSpeed checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ds_trhash.engine_api import DeepSpeedEngine
from ds_trhash.errors import UserError
from ds_trhash.training import config as tcfg
from ds_trhash.training.schedule import build_scheduler


#: the dtype each config precision computes in (DeepSpeed keeps fp32 masters for bf16/fp16)
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    return COMPUTE_DTYPES[precision]


class EngineError(UserError, RuntimeError):
    """A configuration DeepSpeed cannot run, found before any training step."""


NO_DECAY_MARKERS = ("norm",)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into decayed and non-decayed groups.

    docs/contracts.md §6: no weight decay on parameters with ndim < 2 or on norms. Frozen parameters (LoRA
    mode) are left out so the optimizer holds no state for them.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or any(m in name for m in NO_DECAY_MARKERS):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, "name": "decay"})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    if not groups:
        raise EngineError("the model has no trainable parameters; check the LoRA targets in the config")
    if any(getattr(p, "allreduce", True) is False for p in decay + no_decay):
        # Expert-parallel experts: DeepSpeed (ZeRO 1/2) reduces and partitions a group marked
        # `moe` over the expert-data-parallel group named by the group's `name` (ep_size_P).
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = [g for g in split_params_into_different_moe_groups_for_optimizer(groups) if g["params"]]
    return groups


def build_optimizer(model: torch.nn.Module, opt_cfg: tcfg.OptimizerSection, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with the no-decay groups, chosen by ``optimizer.torch_adam``.

    true: torch AdamW (its fused kernel on CUDA, foreach on CPU). false: DeepSpeed's FusedAdam in
    AdamW mode on CUDA (a JIT-built CUDA op). FusedAdam has no CPU kernel, so on CPU false runs
    torch AdamW too; ``optimizer_name`` says which one a launch got.
    """
    groups = param_groups(model, opt_cfg.weight_decay)
    beta1, beta2 = opt_cfg.betas
    if device.type == "cuda" and not opt_cfg.torch_adam:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, adam_w_mode=True, lr=opt_cfg.lr, betas=(beta1, beta2), eps=opt_cfg.eps)
    if device.type == "cuda":
        return torch.optim.AdamW(groups, lr=opt_cfg.lr, betas=(beta1, beta2), eps=opt_cfg.eps, fused=True)
    return torch.optim.AdamW(groups, lr=opt_cfg.lr, betas=(beta1, beta2), eps=opt_cfg.eps)


def optimizer_name(optimizer: torch.optim.Optimizer, opt_cfg: tcfg.OptimizerSection) -> str:
    """What ran, for the startup summary (e.g. torch_adam false on CPU)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wraps it under ZeRO / fp16
    name = f"{type(inner).__module__.split('.')[0]}.{type(inner).__name__}"
    if not opt_cfg.torch_adam and type(inner).__name__ != "FusedAdam":
        name += " (optimizer.torch_adam false: FusedAdam is CUDA-only, so CPU runs torch AdamW)"
    return name


def check_runnable(cfg: tcfg.TrainConfig, world_size: int) -> None:
    """Refuse what DeepSpeed cannot run before any model is allocated, with the reason."""
    if cfg.zero.stage not in (0, 1, 2):
        raise EngineError(
            f"zero.stage={cfg.zero.stage}: the routed-expert (MoE) layers of TR-HASH models are "
            "not supported by DeepSpeed ZeRO-3; use zero.stage 0, 1 or 2"
        )
    ep = cfg.parallel.ep_size
    if ep > 1 and world_size % ep != 0:
        raise EngineError(
            f"parallel.ep_size={ep} does not divide the world size {world_size}; choose an "
            f"expert-parallel size that divides the number of processes"
        )
    if ep > 1:
        check_expert_parallel(cfg)


def check_expert_parallel(cfg: tcfg.TrainConfig) -> None:
    """What expert parallelism (ep_size > 1, ds_trhash.model.expert_parallel) cannot run."""
    ep = cfg.parallel.ep_size
    if cfg.zero.stage == 0:
        raise EngineError(
            f"parallel.ep_size={ep} needs zero.stage 1 or 2: without ZeRO, DeepSpeed 0.19 clips "
            "gradients with runtime.utils.clip_grad_norm_, which averages each rank's own gradient "
            "norm instead of taking the global one; with the experts split over ranks those norms "
            "differ, so clipping would not be the single-rank clipping (ZeRO 1/2 compute the global norm)"
        )
    if cfg.eval.piqa:
        raise EngineError(
            f"parallel.ep_size={ep} with eval.piqa: PIQA is scored on rank 0 alone, while expert-parallel "
            "layers need every rank in every forward; score the exported checkpoint with `ds-trhash eval piqa`")
    if cfg.lora.enabled:
        raise EngineError(
            f"parallel.ep_size={ep} with lora.enabled: LoRA freezes the routed experts (or adapts "
            "them in place), which the expert-parallel layer does not support; use ep_size 1 for LoRA"
        )


def expert_parallel_group(ep_size: int) -> torch.distributed.ProcessGroup:
    """Create DeepSpeed's expert-parallel and expert-data-parallel groups for ep_size (every
    rank, after init_distributed) and return this rank's expert-parallel group. DeepSpeed's
    engine finds them by name (ep_size_<P>) and reduces expert gradients over the latter."""
    # lazy: expert_parallel imports deepspeed.moe (seconds), needed only when ep_size > 1
    from ds_trhash.model.expert_parallel import deepspeed_expert_group

    return deepspeed_expert_group(ep_size)


DEFAULT_GROUP_MINUTES = 30.0  # the default group's timeout unless a launch needs a longer one


def init_distributed(timeout_minutes: float = DEFAULT_GROUP_MINUTES) -> tuple[int, int]:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPUs, gloo on CPU); the default
    group's collectives fail after ``timeout_minutes`` (``entrypoint.group_timeout_minutes``)."""
    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    with without_shared_memory_op():
        deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


@contextlib.contextmanager
def without_shared_memory_op() -> Iterator[None]:
    """Start DeepSpeed's CPU communication on plain gloo, without its shared-memory op.

    On CPU, DeepSpeed's backend builds a C++ op at start-up (a 30-65 s compile in a fresh
    environment, which needs a C++ compiler and ninja) and gives every rank a ~64 MiB segment in
    /dev/shm that it never removes, so each launch, killed or not, left RAM behind. The op serves
    only ``inference_all_reduce`` (tensor-parallel inference), which training never calls; without
    it that call falls back to gloo's all_reduce, and every collective training makes is the same
    gloo call as before. GPUs are untouched (NCCL; DeepSpeed builds no such op there).
    """
    # the module itself: the name ``deepspeed.comm.torch`` as an attribute is torch (a star import)
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")
    build = getattr(ds_torch_backend, "build_shm_op", None)
    if torch.cuda.is_available() or build is None:
        yield
        return
    setattr(ds_torch_backend, "build_shm_op", lambda: None)  # DeepSpeed's module, untyped
    try:
        yield
    finally:
        setattr(ds_torch_backend, "build_shm_op", build)


#: DeepSpeed's default zero_optimization.reduce_bucket_size (elements)
DEEPSPEED_REDUCE_BUCKET = 500_000_000


def with_bucket_fitting(ds_config: dict, model: torch.nn.Module) -> dict:
    """ZeRO 1/2 allocate their gradient bucket whole, ``reduce_bucket_size`` elements (5e8 by
    default: 0.93 GiB in bf16) at every step's first backward, however small the model. A bucket
    as large as the trainable parameters already holds every gradient, so the same reductions run
    in the same groups with less memory (the 200m model: 0.37 GiB). A size the config sets is kept."""
    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage") not in (1, 2) or "reduce_bucket_size" in zero:
        return ds_config
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable >= DEEPSPEED_REDUCE_BUCKET:
        return ds_config
    return {**ds_config, "zero_optimization": {**zero, "reduce_bucket_size": max(trainable, 1)}}


@dataclass
class Engine:
    engine: DeepSpeedEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device


def build_engine(model: torch.nn.Module, cfg: tcfg.TrainConfig, ds_config: dict, total_steps: int, load_universal: bool = False) -> Engine:
    """deepspeed.initialize with the project's optimizer and scheduler.

    ``load_universal``: the engine will load a universal checkpoint (``--reshard`` onto another
    world size, see ``checkpoint.needs_universal``). DeepSpeed reads
    ``"checkpoint": {"load_universal": true}`` only here, at initialize; it changes loading only.
    """
    import deepspeed

    if load_universal:
        ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
    ds_config = with_bucket_fitting(ds_config, model)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    optimizer = build_optimizer(model, cfg.optimizer, device)
    # token positions of one optimizer step over all ranks: sizes a warmup given in tokens
    tokens_per_step = int(ds_config["train_batch_size"]) * cfg.data.seq_len
    scheduler = build_scheduler(optimizer, total_steps, cfg.schedule, tokens_per_step)
    with without_shared_memory_op():  # DeepSpeed starts its communication here when init_distributed did not
        engine, ds_opt, _, ds_sched = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, dist_init_required=False
        )
    return Engine(engine=engine, optimizer=ds_opt, scheduler=ds_sched, device=device)
