"""`ds-trhash model --config FILE [--gpus N --nodes M]`: what a model shape costs, before any GPU.

Parameters (total, and active per token: a token passes through top_k of the routed experts),
training FLOPs per token, and the memory of one GPU for the config's ZeRO stage, ep_size,
precision, micro-batch and sequence length: weights, gradients, optimizer state and activations,
with and without activation checkpointing. The model is built on the meta device (shapes, no
storage: ``training.preparation.footprint``), so a 1B shape costs a fraction of a second on a laptop.

Where DeepSpeed has an estimator of its own (ZeRO 2 with 16-bit weights:
``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``), its figure for
the model states is printed beside ours: once for the dense parameters over every GPU, once for a
rank's routed experts over its expert-data-parallel group.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ds_trhash.argtypes import positive_int

if TYPE_CHECKING:  # the training config is imported where a command runs
    from ds_trhash.training.config import TrainConfig

GIB = 1024**3


@dataclass(frozen=True)
class SizeEstimate:
    """Every figure ``ds-trhash model`` prints (bytes per GPU unless named otherwise)."""

    model: str
    shape: dict
    gpus: int
    nodes: int
    zero_stage: int
    ep_size: int
    precision: str
    micro_batch: int
    seq_len: int
    total_params: int
    trainable_params: int  # LoRA: the adapters only
    active_params: int
    params_per_gpu: int
    train_flops_per_token: float
    weights: int
    gradients: int
    optimizer: int
    activations: int  # as configured (model.activation_checkpointing)
    activations_none: int
    activations_full: int
    runtime: int  # CUDA context and allocator slack
    deepspeed_model_states: int | None  # DeepSpeed's own ZeRO-2 figure, where it applies
    buffers: int = 0  # DeepSpeed's gradient bucket(s) (ZeRO 1/2)
    fused_kernels: bool = True  # activations counted for Triton experts + Liger (kernels.policy auto/triton)

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    def per_gpu(self, activations: int) -> int:
        return self.weights + self.gradients + self.optimizer + self.buffers + activations + self.runtime


def active_parameters(total: int, routed: int, num_experts: int, top_k: int) -> int:
    """Parameters one token passes through: every parameter but the routed experts it skips."""
    return total - routed * (num_experts - top_k) // num_experts


def deepspeed_zero2_states(dense: int, expert_per_rank: int, world: int, ep_size: int) -> int:
    """DeepSpeed's ZeRO-2 model-state estimate per GPU (no offload): the dense parameters
    partitioned over every GPU, plus this rank's routed experts over its expert-data-parallel group."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu_dense = estimate_zero2_model_states_mem_needs(dense, num_gpus_per_node=world, num_nodes=1,
                                                         cpu_offload=False)
    _, gpu_experts = (0, 0) if not expert_per_rank else estimate_zero2_model_states_mem_needs(
        expert_per_rank, num_gpus_per_node=max(1, world // ep_size), num_nodes=1, cpu_offload=False)
    return gpu_dense + gpu_experts


def estimate_size(cfg: TrainConfig, gpus: int = 1, nodes: int = 1) -> SizeEstimate:
    """The figures of ``cfg`` on ``gpus`` GPUs on each of ``nodes`` nodes; ConfigError when the
    world size cannot hold the config (ep_size, the global batch)."""
    from ds_trhash.model.flops import train_flops_per_token
    from ds_trhash.training import config as tcfg
    from ds_trhash.training.preparation import footprint as fp

    world = gpus * nodes
    if cfg.batch.micro_batch == "auto":  # an estimate has no device to fit: the one the chooser would try first
        raise tcfg.ConfigError(cfg.origin, "batch.micro_batch", "auto is chosen at launch from the device's memory; "
                               "give a number with --set batch.micro_batch=N to see its estimate")
    cfg = tcfg.for_world(cfg, world)
    mc = tcfg.model_config(cfg)
    foot = fp.estimate(cfg, mc, world, "cuda")
    params = foot.params
    act = {mode: fp.activation_bytes(cfg, mc, mc.num_layers if mode == "full" else 0, "cuda")
           for mode in ("none", "full")}
    mixed = fp.PRECISION_BYTES[cfg.precision] == 2
    ds_states = None
    if cfg.zero.stage == 2 and mixed and params.trainable == params.total:
        dense = params.trainable_per_rank - params.expert_trainable_per_rank
        ds_states = deepspeed_zero2_states(dense, params.expert_trainable_per_rank, world, cfg.parallel.ep_size)
    return SizeEstimate(
        model=cfg.model.describe(), shape={k: v for k, v in asdict(mc).items()
                                                if k not in ("loss_chunk_tokens", "route_weights")},
        gpus=gpus, nodes=nodes, zero_stage=cfg.zero.stage, ep_size=cfg.parallel.ep_size, precision=cfg.precision,
        micro_batch=tcfg.micro_batch(cfg), seq_len=cfg.data.seq_len, total_params=params.total,
        trainable_params=params.trainable,
        active_params=active_parameters(params.total, params.routed_total, mc.num_experts, mc.top_k),
        params_per_gpu=params.per_rank, train_flops_per_token=train_flops_per_token(mc, cfg.data.seq_len),
        weights=foot.weights, gradients=foot.gradients, optimizer=foot.optimizer, activations=foot.activations,
        activations_none=act["none"], activations_full=act["full"], runtime=foot.runtime,
        deepspeed_model_states=ds_states, buffers=foot.buffers, fused_kernels=fp.fused_kernels(cfg.kernels, "cuda"))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def render(e: SizeEstimate) -> str:
    """The figures for people, one per line."""
    gpus = f"{e.gpus} GPU{'s' if e.gpus != 1 else ''}" + (f" x {e.nodes} nodes" if e.nodes > 1 else "")
    s = e.shape
    lines = [
        f"model       {e.model}",
        f"shape       vocab {s['vocab_size']:,}, hidden {s['hidden_size']}, {s['num_layers']} layers, "
        f"{s['num_heads']} heads ({s['num_kv_heads']} kv) of {s['head_dim']}, shared {s['shared_width']}, "
        f"{s['num_experts']} experts of {s['expert_width']} (top {s['top_k']}), {s['max_seq_len']} positions",
        f"parameters  {e.total_params:,} total, {e.active_params:,} active per token, {e.params_per_gpu:,} per GPU"
        + (f", {e.trainable_params:,} trainable" if e.trainable_params != e.total_params else ""),
        f"FLOPs       {e.train_flops_per_token:.4g} per token trained (forward + backward, seq_len {e.seq_len})",
        f"layout      {gpus}, ZeRO {e.zero_stage}, ep_size {e.ep_size}, {e.precision}, "
        f"micro-batch {e.micro_batch} x {e.seq_len} tokens",
        "memory per GPU (estimate)",
        f"  weights         {_gib(e.weights)}",
        f"  gradients       {_gib(e.gradients)}",
        f"  optimizer       {_gib(e.optimizer)}  (Adam moments{', fp32 master weights' if e.precision != 'fp32' else ''})",
        f"  buffers         {_gib(e.buffers)}  (DeepSpeed's gradient bucket, zero_optimization.reduce_bucket_size)",
        f"  activations     {_gib(e.activations_none)} without activation checkpointing, "
        f"{_gib(e.activations_full)} with (full); "
        + ("Triton experts, Liger norm/RoPE/loss" if e.fused_kernels else "PyTorch kernels (kernels.policy pytorch)"),
        *(["                  (on the GPU the fused kernels keep other tensors than the CPU path: Triton keeps h, g, u of every routed row for backward, "
           "which the PyTorch path recomputes; Liger's loss keeps its gradients, [tokens, hidden] and fp32 "
           "[vocab, hidden], on its ctx, outside autograd's saved tensors; Liger's norms keep no fp32 copy)"]
          if e.fused_kernels else []),
        f"  runtime         {_gib(e.runtime)}  (CUDA context, allocator slack)",
        f"  total           {_gib(e.per_gpu(e.activations_none))} without activation checkpointing, "
        f"{_gib(e.per_gpu(e.activations_full))} with",
    ]
    if e.deepspeed_model_states is not None:
        lines.append(f"DeepSpeed's ZeRO-2 estimate of the model states (estimate_zero2_model_states_mem_needs, no "
                     f"offload): {_gib(e.deepspeed_model_states)} per GPU; ours: "
                     f"{_gib(e.weights + e.gradients + e.optimizer)}")
    else:
        lines.append("DeepSpeed's estimator: not applicable (it models ZeRO 2 with 16-bit weights, all trainable)")
    return "\n".join(lines)


@contextlib.contextmanager
def _deepspeed_quiet() -> Iterator[None]:
    """DeepSpeed's logger writes to stdout, on import too (which accelerator this machine has,
    irrelevant to an estimate for GPUs); the figures own stdout (``--json`` is parsed), so its
    records below ERROR are dropped meanwhile. A filter on the logger by name, set before the
    import, holds whether or not DeepSpeed was imported already."""
    ds_logger = logging.getLogger("DeepSpeed")

    def errors_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    ds_logger.addFilter(errors_only)
    try:
        yield
    finally:
        ds_logger.removeFilter(errors_only)


def run_model(args: argparse.Namespace) -> int:
    from ds_trhash.training import config as tcfg

    with _deepspeed_quiet():  # a deepspeed: section is checked by DeepSpeed's reader at load
        cfg = tcfg.load_config(args.config, list(args.set))
        estimate = estimate_size(cfg, args.gpus, args.nodes)
    if args.json:
        print(json.dumps({**asdict(estimate), "per_gpu": estimate.per_gpu(estimate.activations_none),
                          "per_gpu_checkpointed": estimate.per_gpu(estimate.activations_full)}, indent=2))
    else:
        print(render(estimate))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="parameters, FLOPs per token and memory per GPU of a config's model, "
                                     "without allocating it",
                       description="Counts the model of a stage config on the meta device and estimates one GPU's "
                                   "memory for its ZeRO stage, ep_size, precision, micro-batch and sequence length.")
    p.add_argument("--config", required=True, help="YAML stage config, e.g. ds_configs/200m/pretrain.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, as for a launch (repeatable)")
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (bytes, counts)")
    p.set_defaults(func=run_model)
