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

import math
from typing import TYPE_CHECKING
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ds_trhash.model import TRHashForCausalLM
from ds_trhash.model.config import TRHashConfig
from ds_trhash.model.lora import apply_lora
from ds_trhash.training import config as tcfg
from ds_trhash.training.config import KernelsSection, ParallelSection, TrainConfig

GIB = 1024**3
FP32 = 4
ADAM_MOMENTS = 2 * FP32  # exp_avg and exp_avg_sq per trainable parameter, always fp32
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Resident size of one training process besides the model, optimizer and activations
# (interpreter, torch, DeepSpeed, the CPU communication op, data), on CPU; set from a tiny-preset
# rank's peak under `ds-trhash smoke` (docs/performance.md, "Sizes").
CPU_PROCESS_BYTES = int(0.5 * GIB)
# A CUDA context and the caching allocator's slack on one device.
CUDA_CONTEXT_BYTES = int(1.0 * GIB)
# A loss chunk's logits, their softmax and its gradient, in fp32 (the chunked CE).
_LOGIT_COPIES = 3
# DeepSpeed's ZeRO 1/2 gradient bucket (zero_optimization.reduce_bucket_size), in elements.
DEFAULT_REDUCE_BUCKET = 500_000_000

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

if TYPE_CHECKING:  # the config's type name only
    from ds_trhash.training.config import TrainConfig


@dataclass(frozen=True)
class Footprint:
    params: ParamCount
    weights: int  # module weights in the training precision and buffers, one rank
    gradients: int
    optimizer: int  # Adam moments and fp32 master weights (bf16/fp16), ZeRO-partitioned, one rank
    activations: int  # one micro-batch forward + backward, one rank
    runtime: int  # process / CUDA context overhead
    checkpoint: int  # one complete checkpoint on disk, all ranks together
    buffers: int = 0  # DeepSpeed's gradient bucket(s) during backward (ZeRO 1/2)

    @property
    def per_rank(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.buffers + self.activations + self.runtime

    def describe(self) -> str:
        return (f"{self.params.total / 1e6:.1f}M parameters ({self.params.trainable / 1e6:.1f}M trainable): "
                f"weights {gib(self.weights)} + gradients {gib(self.gradients)} + optimizer {gib(self.optimizer)} "
                f"+ buffers {gib(self.buffers)} + activations {gib(self.activations)} + runtime {gib(self.runtime)} "
                f"= {gib(self.per_rank)} per rank")


def gib(n: float) -> str:
    """Bytes for people: GiB above one, MiB below."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


def _is_routed_expert(name: str, ndim: int) -> bool:
    # stacked [E, H, W] expert weights; expert parallelism splits their first dimension
    return ndim == 3 and ".expert_" in name


def _shapes_only() -> TorchFunctionMode:
    """A torch function mode that skips random initialisation: on the meta device there are no
    values to draw, and PyTorch's meta versions of the init ops would import the compiler stack
    (seconds) for nothing."""
    class SkipInit(TorchFunctionMode):
        SKIP = frozenset({"normal_", "uniform_", "trunc_normal_"})

        def __torch_function__(self, func: Callable[..., object], types: object, args: tuple = (),
                               kwargs: dict | None = None) -> object:
            if getattr(func, "__name__", None) in self.SKIP:
                return args[0] if args else (kwargs or {})["tensor"]
            return func(*args, **(kwargs or {}))

    return SkipInit()


def meta_model(cfg: TrainConfig, model_cfg: TRHashConfig) -> TRHashForCausalLM:
    """The model this config trains, on the meta device: LoRA adapters and activation
    checkpointing as the launch sets them, no storage."""
    with torch.device("meta"), _shapes_only():
        model = TRHashForCausalLM(model_cfg)
        if cfg.lora.enabled:
            apply_lora(model, cfg.lora)
    model.set_activation_checkpointing(cfg.model.activation_checkpointing, cfg.model.activation_checkpointing_every)
    return model


def count_parameters(parallel: ParallelSection, model: TRHashForCausalLM) -> ParamCount:
    """Exact parameter counts of ``meta_model(cfg, ...)``; per rank with ``parallel.ep_size``."""
    ep = parallel.ep_size
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


def fused_kernels(kernels: KernelsSection, device_type: str) -> bool:
    """Whether the launch runs the fused kernels (Triton experts, Liger norm/RoPE/loss): on CUDA
    under kernels.policy auto or triton (Liger assumed importable there), never on CPU."""
    return device_type == "cuda" and kernels.policy in ("auto", "triton")


def _norm_bytes(width: int, act: int, fused: bool) -> int:
    """What one RMSNorm over ``width`` keeps per token: Liger its input and an fp32 1/rms per row;
    the PyTorch reference its input in fp32 (a copy when the activations are 16-bit) and the
    normalised value."""
    if fused:
        return width * act
    return width * FP32 + width * act if act < FP32 else 2 * width * act


@dataclass(frozen=True)
class FusedParts:
    """Which parts run a fused kernel that keeps other tensors than the PyTorch path: the experts
    (Triton), the norms and the loss (Liger). ``of(backends)`` reads a model's ``backends_used()``."""
    experts: bool
    norm: bool
    loss: bool

    @classmethod
    def all(cls, fused: bool) -> "FusedParts":
        return cls(fused, fused, fused)

    @classmethod
    def of(cls, backends: dict) -> "FusedParts":
        return cls(backends.get("experts") == "triton", backends.get("norm") == "liger", backends.get("loss") == "liger")


def layer_bytes_per_token(model_cfg: TRHashConfig, act: int, fused: bool | FusedParts) -> int:
    """Bytes autograd keeps per token for one decoder layer (checked against saved-tensor counts
    in tests/prelaunch/test_model_size.py):

    norms:      input and post-attention norm over H, q/k norm over the heads' widths (QK-norm)
    outputs:    both norms' outputs (H each; the projections, MLP and experts share them)
    attention:  v, the rotated q and k, the output (the o-projection's input) and fp32 log-sum-exp
    shared MLP: gate, silu(gate), up, their product -> 4·S
    routed:     Triton: h, g, u of each (token, route) row -> 3·top_k·W; the PyTorch gathered
                path recomputes them in backward and keeps nothing but its input
    RoPE keeps only cos/sin (both paths); Liger's and the reference's 1/rms rows are fp32.
    """
    c, parts = model_cfg, fused if isinstance(fused, FusedParts) else FusedParts.all(fused)
    h, s, w = c.hidden_size, c.shared_width, c.expert_width
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rows = 2 + c.num_heads + c.num_kv_heads  # 1/rms per row of each norm, fp32
    norms = 2 * _norm_bytes(h, act, parts.norm) + _norm_bytes(q + kv, act, parts.norm) + rows * FP32
    attention = (kv + (q + kv) + q) * act + c.num_heads * FP32
    routed = 3 * c.top_k * w * act if parts.experts else 0
    return norms + 2 * h * act + attention + 4 * s * act + routed


def loss_bytes(kernels: KernelsSection, model_cfg: TRHashConfig, tokens: int, act: int, fused: bool | FusedParts,
               transient: bool = True) -> int:
    """The head: the final norm, what the loss keeps until backward and its largest temporary.
    Liger's fused linear CE computes the gradients in forward and keeps grad_input [N, H] and an
    fp32 grad_weight [V, H]; its logits come in chunks of about N / ceil(V / H) rows. The chunked
    CE keeps the hidden rows and one fp32 log-sum-exp each, and scores ``loss_chunk_tokens`` rows
    at a time. ``transient``: with that largest temporary (the peak); without it, what autograd
    keeps (tensors saved for backward and on a custom function's ``ctx``: Liger keeps its
    gradients there, where saved-tensor hooks do not see them)."""
    parts = fused if isinstance(fused, FusedParts) else FusedParts.all(fused)
    h, v = model_cfg.hidden_size, model_cfg.vocab_size
    final_norm = tokens * (_norm_bytes(h, act, parts.norm) + FP32)
    if parts.loss:
        chunk = min(tokens, 1 << max(0, math.ceil(math.log2(tokens / math.ceil(v / h)))))
        return final_norm + tokens * h * act + v * h * FP32 + (chunk * v * FP32 if transient else 0)
    chunk = min(kernels.loss_chunk_tokens, tokens)
    return final_norm + tokens * (h * act + FP32) + (_LOGIT_COPIES * chunk * v * FP32 if transient else 0)


def activation_bytes(cfg: TrainConfig, model_cfg: TRHashConfig, checkpointed: int = 0, device_type: str = "cuda",
                     transient: bool = True, fused: FusedParts | None = None) -> int:
    """One micro-batch [micro_batch, seq_len] through every layer and the loss, for the kernels
    ``device_type`` runs (or the ``fused`` parts given). A ``checkpointed`` layer keeps only its
    input and is recomputed, one at a time, in backward (``transient``: that recompute and the
    loss's largest temporary, the peak; without: what autograd keeps at the end of the forward)."""
    tokens = tcfg.micro_batch(cfg) * cfg.data.seq_len
    act = PRECISION_BYTES[cfg.precision]
    parts = fused if fused is not None else FusedParts.all(fused_kernels(cfg.kernels, device_type))
    per_layer = layer_bytes_per_token(model_cfg, act, parts)
    kept = (model_cfg.num_layers - checkpointed) * per_layer + checkpointed * model_cfg.hidden_size * act
    layers = tokens * (kept + (per_layer if checkpointed and transient else 0))
    return layers + loss_bytes(cfg.kernels, model_cfg, tokens, act, parts, transient)


def gradient_buffers(cfg: TrainConfig, params: ParamCount) -> int:
    """DeepSpeed's ZeRO 1/2 optimizer copies gradients into a contiguous bucket of
    ``reduce_bucket_size`` elements (two with overlap_comm), allocated whole at the first backward;
    unless the config sets it, the engine sizes it to the trainable parameters when they are fewer
    than DeepSpeed's default (training.engine.with_bucket_fitting)."""
    if cfg.zero.stage not in (1, 2):
        return 0
    zero = (cfg.deepspeed or {}).get("zero_optimization") or {}
    if zero.get("contiguous_gradients", True) is False:
        return 0
    bucket = int(zero.get("reduce_bucket_size", min(DEFAULT_REDUCE_BUCKET, max(params.trainable_per_rank, 1))))
    copies = 2 if zero.get("overlap_comm", False) else 1
    return copies * bucket * PRECISION_BYTES[cfg.precision]


def checkpoint_bytes(cfg: TrainConfig, params: ParamCount, world: int) -> int:
    """One checkpoint as DeepSpeed writes it: the module in the training precision (rank 0, all
    experts), fp32 Adam moments for every trainable parameter, and fp32 master weights wherever
    they exist apart from the module (bf16/fp16, or ZeRO partitions)."""
    p = PRECISION_BYTES[cfg.precision]
    master = FP32 if (p != FP32 or cfg.zero.stage >= 1) else 0
    small = 64 * 1024 * (world + 1)  # RNG states, trainer state, manifest
    return params.total * p + params.buffer_bytes + params.trainable * (ADAM_MOMENTS + master) + small


def estimate(cfg: TrainConfig, model_cfg: TRHashConfig, world: int, device_type: str) -> Footprint:
    """The footprint of one rank of ``world`` for ``cfg`` on a ``device_type`` ("cuda" or "cpu")."""
    model = meta_model(cfg, model_cfg)
    params = count_parameters(cfg.parallel, model)
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
                     activations=activation_bytes(cfg, model_cfg, checkpointed, device_type), runtime=runtime,
                     checkpoint=checkpoint_bytes(cfg, params, world), buffers=gradient_buffers(cfg, params))
