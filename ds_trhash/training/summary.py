"""The startup summary: one block on rank 0 saying what this launch is about to train.

Everything a reader of a log needs to tell two runs apart without opening their configs:
model size (and what trains, LoRA included), the global batch and how it is cut for this world
size, steps, precision, ZeRO stage, optimizer, the learning-rate schedule in steps, kernels, activation checkpointing and the
DeepSpeed features the ``deepspeed:`` section turned on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # summary.py is read without torch by the preflight's messages
    import torch

    from ds_trhash.model import TRHashForCausalLM
    from ds_trhash.training.global_batch import GlobalBatch

from ds_trhash.training import deepspeed_config as dsc
from ds_trhash.training import determinism
from ds_trhash.training.config import TrainConfig
from ds_trhash.training.schedule import describe_schedule

__all__ = ["parameter_counts", "startup_summary"]


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, trainable parameters) held by this rank's model."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return total, trainable


def startup_summary(cfg: TrainConfig, layout: GlobalBatch, *, model: TRHashForCausalLM, total_steps: int, start_step: int, ds_config: Mapping[str, Any],
                    optimizer: str, kernels: Mapping[str, Any] | None, hardware: str,
                    checkpointed_layers: list[int], device_type: str = "cpu") -> str:
    total, trainable = parameter_counts(model)
    lora = (f", LoRA rank {cfg.lora.rank} on {', '.join(cfg.lora.targets)}"
            + (" + experts" if cfg.lora.experts else "")) if cfg.lora.enabled else ""
    ep = f" (this rank's share; experts split over ep_size {cfg.parallel.ep_size})" if cfg.parallel.ep_size > 1 else ""
    ac: str = cfg.model.activation_checkpointing
    if ac != "none":
        ac = f"{ac}{'' if ac == 'full' else ' ' + str(cfg.model.activation_checkpointing_every)}: " \
             f"{len(checkpointed_layers)} of {len(model.layers)} decoder layers recomputed in backward"
    features = dsc.features_on(ds_config)
    kern = ", ".join(f"{k} {v}" for k, v in (kernels or {}).items())
    lines = [
        f"{cfg.stage} on {layout.world_size} process(es): {hardware}",
        f"model      {cfg.model.describe()}: {total:,} parameters, {trainable:,} trainable{lora}{ep}",
        f"batch      {layout.describe()}",
        f"steps      {total_steps:,}" + (f", resuming after step {start_step:,}" if start_step else ""),
        f"precision  {cfg.precision}, ZeRO stage {cfg.zero.stage}, optimizer {optimizer}",
        f"schedule   {describe_schedule(cfg.schedule, total_steps, layout.global_tokens, cfg.optimizer.lr)}",
        f"kernels    policy {cfg.kernels.policy}: {kern or 'not resolved'}",
        f"determinism  {determinism.describe(cfg.training.deterministic, device_type)}",
        f"activation checkpointing  {ac}",
        f"deepspeed  {', '.join(features) if features else 'no optional features (deepspeed: section empty)'}",
    ]
    return "startup summary\n" + "\n".join(f"  {line}" for line in lines)
