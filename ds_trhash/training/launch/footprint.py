"""What one stage needs from a machine: parameters, memory per rank and bytes per checkpoint.

Counted from the config alone, before anything is allocated: the model is built on PyTorch's
meta device (shapes without storage), so the parameter count is exact for every preset, with
LoRA adapters and expert parallelism, and costs a fraction of a second. Memory and checkpoint
sizes follow from that count and the precision, ZeRO stage and micro-batch shapes.

The memory figure is an estimate (the activation term models what autograd keeps per token and
layer, not the allocator); ``ds-trhash smoke`` measures the real peak. The checkpoint size is
what DeepSpeed writes for these settings (module weights in the training precision, fp32
master weights and Adam moments), within a few per cent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ds_trhash.model import TRHashForCausalLM
from ds_trhash.model.lora import apply_lora

GIB = 1024**3
FP32 = 4
ADAM_MOMENTS = 2 * FP32  # exp_avg and exp_avg_sq per trainable parameter, always fp32
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Resident size of one training process besides the model, optimizer and activations
# (interpreter, torch, DeepSpeed, the CPU communication op, data): a tiny-preset rank peaked at
# 551 MiB RSS with 83 MiB of those on CPU with torch 2.13 / DeepSpeed 0.19 (ds-trhash smoke).
CPU_PROCESS_BYTES = int(0.5 * GIB)
# A CUDA context and the caching allocator's slack on one device.
CUDA_CONTEXT_BYTES = int(1.0 * GIB)
# Saved-for-backward elements per token per layer, in the activation dtype (see activation_bytes).
_LOGIT_COPIES = 3  # a loss chunk's logits, their softmax and its gradient, in fp32


@dataclass(frozen=True)
class ParamCount:
    total: int  # every parameter of the model
    trainable: int  # what the optimizer updates (LoRA: the adapters only)
    per_rank: int  # held by one rank (expert parallel: only its share of the routed experts)
    trainable_per_rank: int
    buffer_bytes: int  # route tables and other persistent buffers (saved with the module)
    # of trainable_per_rank, the routed experts': ZeRO partitions them over the expert-data-parallel
    # group (world / ep_size ranks), the rest over every rank
    expert_trainable_per_rank: int = 0
    routed_total: int = 0  # every routed expert's parameters, all ranks (for the active count)


@dataclass(frozen=True)
class Footprint:
    params: ParamCount
    weights: int  # module weights in the training precision and buffers, one rank
    gradients: int
    optimizer: int  # Adam moments and fp32 master weights (bf16/fp16), ZeRO-partitioned, one rank
    activations: int  # one micro-batch forward + backward, one rank
    runtime: int  # process / CUDA context overhead
    checkpoint: int  # one complete checkpoint on disk, all ranks together

    @property
    def per_rank(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.runtime

    def describe(self) -> str:
        return (f"{self.params.total / 1e6:.1f}M parameters ({self.params.trainable / 1e6:.1f}M trainable): "
                f"weights {gib(self.weights)} + gradients {gib(self.gradients)} + optimizer {gib(self.optimizer)} "
                f"+ activations {gib(self.activations)} + runtime {gib(self.runtime)} = {gib(self.per_rank)} per rank")


def gib(n: float) -> str:
    """Bytes for people: GiB above one, MiB below."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


def _is_routed_expert(name: str, ndim: int) -> bool:
    # stacked [E, H, W] expert weights; expert parallelism splits their first dimension
    return ndim == 3 and ".expert_" in name


def _shapes_only():
    """A torch function mode that skips random initialisation: on the meta device there are no
    values to draw, and PyTorch's meta versions of the init ops would import the compiler stack
    (seconds) for nothing."""
    class SkipInit(TorchFunctionMode):
        SKIP = frozenset({"normal_", "uniform_", "trunc_normal_"})

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", None) in self.SKIP:
                return args[0] if args else kwargs["tensor"]
            return func(*args, **(kwargs or {}))

    return SkipInit()


def meta_model(cfg, model_cfg) -> TRHashForCausalLM:
    """The model this config trains, on the meta device: LoRA adapters and activation
    checkpointing as the launch sets them, no storage."""
    with torch.device("meta"), _shapes_only():
        model = TRHashForCausalLM(model_cfg)
        if cfg.lora.enabled:
            apply_lora(model, cfg.lora)
    model.set_activation_checkpointing(cfg.model.activation_checkpointing, cfg.model.activation_checkpointing_every)
    return model


def count_parameters(cfg, model: TRHashForCausalLM) -> ParamCount:
    """Exact parameter counts of ``meta_model(cfg, ...)``."""
    ep = cfg.parallel.ep_size
    total = trainable = per_rank = trainable_per_rank = expert_trainable = routed = 0
    for name, p in model.named_parameters():
        n = p.numel()
        expert = _is_routed_expert(name, p.ndim)
        local = n // ep if expert else n
        total += n
        per_rank += local
        routed += n if expert else 0
        if p.requires_grad:
            trainable += n
            trainable_per_rank += local
            expert_trainable += local if expert else 0
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return ParamCount(total, trainable, per_rank, trainable_per_rank, buffers, expert_trainable, routed)


def activation_elements_per_token(model_cfg) -> int:
    """Tensors autograd keeps for backward, per token and layer, in elements.

    attention: residual in, norm out, q/k/v, rotated q/k, attention out, o_proj out
               -> 3·H + 3·(heads·head_dim) + 3·(kv_heads·head_dim)
    shared MLP: residual in, norm out, gate, up, silu(gate), product, down out -> 3·H + 4·S
    routed:    per route, the gathered tokens, gate|up, silu, product, weighted, down out
               -> top_k·(2·H + 5·W)
    residual sums: 2·H
    """
    c = model_cfg
    h, s, w = c.hidden_size, c.shared_width, c.expert_width
    attn = 3 * h + 3 * c.num_heads * c.head_dim + 3 * c.num_kv_heads * c.head_dim
    return attn + (3 * h + 4 * s) + c.top_k * (2 * h + 5 * w) + 2 * h


def activation_bytes(cfg, model_cfg, checkpointed: int = 0) -> int:
    """One micro-batch [micro_batch, seq_len] through every layer, plus one loss chunk's logits.
    A ``checkpointed`` layer keeps only its input and is recomputed, one at a time, in backward."""
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    act = PRECISION_BYTES[cfg.precision]
    per_layer = activation_elements_per_token(model_cfg)
    kept = (model_cfg.num_layers - checkpointed) * per_layer + checkpointed * model_cfg.hidden_size
    layers = tokens * (kept + (per_layer if checkpointed else 0)) * act
    embeddings = 2 * tokens * model_cfg.hidden_size * act  # embedding out, final norm
    chunk = min(cfg.kernels.loss_chunk_tokens, tokens)
    logits = _LOGIT_COPIES * chunk * model_cfg.vocab_size * FP32
    return layers + embeddings + logits


def checkpoint_bytes(cfg, params: ParamCount, world: int) -> int:
    """One checkpoint as DeepSpeed writes it: the module in the training precision (rank 0, all
    experts), fp32 Adam moments for every trainable parameter, and fp32 master weights wherever
    they exist apart from the module (bf16/fp16, or ZeRO partitions)."""
    p = PRECISION_BYTES[cfg.precision]
    master = FP32 if (p != FP32 or cfg.zero.stage >= 1) else 0
    small = 64 * 1024 * (world + 1)  # RNG states, trainer state, manifest
    return params.total * p + params.buffer_bytes + params.trainable * (ADAM_MOMENTS + master) + small


def estimate(cfg, model_cfg, world: int, device_type: str) -> Footprint:
    """The footprint of one rank of ``world`` for ``cfg`` on a ``device_type`` ("cuda" or "cpu")."""
    model = meta_model(cfg, model_cfg)
    params = count_parameters(cfg, model)
    checkpointed = sum(1 for layer in model.layers if layer.checkpointed)
    p = PRECISION_BYTES[cfg.precision]
    zero = cfg.zero.stage
    mixed = p != FP32
    weights = params.per_rank * p + params.buffer_bytes
    # ZeRO 1/2 partition the optimizer state (ZeRO 2 the gradients too) over the data-parallel
    # ranks; a routed expert's over its expert-data-parallel group only (world / ep_size ranks).
    dense = params.trainable_per_rank - params.expert_trainable_per_rank
    groups = (world, max(1, world // cfg.parallel.ep_size))

    def partitioned(bytes_each: int, on: bool) -> int:
        dp, edp = groups if on else (1, 1)
        return dense * bytes_each // dp + params.expert_trainable_per_rank * bytes_each // edp

    master = partitioned(FP32, zero >= 1) if mixed else 0
    grads = partitioned(p, zero >= 2)
    optimizer = partitioned(ADAM_MOMENTS, zero >= 1) + master
    runtime = CUDA_CONTEXT_BYTES if device_type == "cuda" else CPU_PROCESS_BYTES
    return Footprint(params=params, weights=weights, gradients=grads, optimizer=optimizer,
                     activations=activation_bytes(cfg, model_cfg, checkpointed), runtime=runtime,
                     checkpoint=checkpoint_bytes(cfg, params, world))
