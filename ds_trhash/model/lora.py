"""LoRA adapters for SFT LoRA mode (docs/contracts.md §6).

`apply_lora(model, lora)` wraps the chosen projections in place and freezes everything
else. The state dict of a wrapped model keeps every base name unchanged
(`layers.0.self_attn.q_proj.weight` stays that key) and adds only adapter tensors:

- a wrapped linear `P` adds `P.lora_A` [r, in] and `P.lora_B` [out, r];
  y = P.weight·x + (alpha/r) · B·A·dropout(x);
- with `experts: true`, each MoE engine adds `expert_{gate,up,down}_lora.lora_A` [E, in, r]
  and `.lora_B` [E, r, out] (x @ W layout, like the stacked weights) and the routed experts
  run on W_e + (alpha/r) · A_e·B_e. These adapters have no dropout: they act on the weights.

B starts at zero, so a freshly wrapped model computes exactly what the base model does.
`merge_lora` folds the adapters back into a plain state dict with the keys of an unwrapped
`TRHashForCausalLM`. Full-parameter and LoRA runs never resume from each other; the resume
checks use `has_lora_state` / `check_state_mode`. The config's `lora:` section (`LoraSection`)
is declared here, beside the targets it may name.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_trhash.config_fields import half_open_unit, positive, setting
from ds_trhash.errors import UserError

from .decoder import TRHashMoEEngine
from .transformer import TRHashForCausalLM


__all__ = [
    "LoRAError",
    "LoRALinear",
    "ExpertAdapter",
    "LoRAMoEEngine",
    "LINEAR_TARGETS",
    "EXPERT_WEIGHTS",
    "LoraSection",
    "apply_lora",
    "is_lora_key",
    "has_lora_state",
    "check_state_mode",
    "lora_state_dict",
    "load_lora_state_dict",
    "merge_lora",
    "merge_lora_state_dict",
    "trainable_parameter_count",
]

# Where each wrappable linear lives inside a decoder layer.
LINEAR_TARGETS: dict[str, str] = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "shared_gate": "mlp.engine.shared_gate",
    "shared_up": "mlp.engine.shared_up",
    "shared_down": "mlp.engine.shared_down",
}
# The names a config may list under lora.targets, and the default list (every attention
# projection but k_proj, and the shared expert's three linears).
LORA_TARGETS = tuple(LINEAR_TARGETS)
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj", "o_proj", "shared_gate", "shared_up", "shared_down")
# Stacked routed-expert weights adapted when `experts` is on; adapter module = name + "_lora".
EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")
_ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def _lora_targets(v: tuple[str, ...]) -> str | None:
    if not v:
        return f"must name at least one layer; allowed: {', '.join(LORA_TARGETS)}"
    unknown = [t for t in v if t not in LORA_TARGETS]
    if unknown:
        return f"unknown target(s) {unknown}; allowed: {', '.join(LORA_TARGETS)}"
    if len(set(v)) != len(v):
        return f"duplicate targets in {list(v)}"
    return None


@dataclass(frozen=True)
class LoraSection:
    """The config's ``lora:`` section (SFT LoRA mode; the YAML keys are these field names)."""

    enabled: bool = False
    rank: int = setting(16, check=positive)
    alpha: float = setting(16.0, check=positive)
    dropout: float = setting(0.05, check=half_open_unit)
    targets: tuple[str, ...] = setting(DEFAULT_LORA_TARGETS, check=_lora_targets)
    experts: bool = False  # the stacked routed-expert weights too
_EXPERT_ADAPTER_SUFFIX = "_lora"


class LoRAError(UserError, ValueError):
    """A LoRA set-up or a checkpoint/mode combination that must not run; message is for the user."""


def _init_down_projection(a: torch.Tensor, fan_in: int) -> None:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): kaiming-uniform with a = sqrt(5), as nn.Linear's
    default, with fan_in given explicitly so the stacked [E, in, r] layout is handled too."""
    if a.is_meta:
        return
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        a.uniform_(-bound, bound)


class LoRALinear(nn.Module):
    """A frozen bias-free or biased linear plus a trainable low-rank update.

    The base `weight` (and `bias`) are the wrapped layer's own Parameter objects, registered
    directly on this module, so the state-dict keys of the base layer do not change.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        _check_hyper(rank, alpha, dropout)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.scaling = self.alpha / self.rank
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device, dtype = self.weight.device, self.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(self.rank, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, self.rank, device=device, dtype=dtype))
        _init_down_projection(self.lora_A, self.in_features)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return base + update * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """(alpha/r) · B·A in fp32, shaped like `weight`."""
        return (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha/r) · B·A, summed in fp32, returned in the weight's dtype."""
        return (self.weight.detach().float() + self.delta_weight()).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, alpha={self.alpha:g}")


class ExpertAdapter(nn.Module):
    """Per-expert low-rank update of one stacked weight W [E, in, out] (x @ W layout):
    delta_e = (alpha/r) · A_e·B_e with A [E, in, r] (random) and B [E, r, out] (zeros)."""

    def __init__(self, weight: torch.Tensor, rank: int, alpha: float) -> None:
        super().__init__()
        _check_hyper(rank, alpha, 0.0)
        experts, fan_in, fan_out = weight.shape
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.scaling = self.alpha / self.rank
        device, dtype = weight.device, weight.dtype
        self.lora_A = nn.Parameter(torch.empty(experts, fan_in, self.rank, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(experts, self.rank, fan_out, device=device, dtype=dtype))
        _init_down_projection(self.lora_A, fan_in)

    def delta(self) -> torch.Tensor:
        """(alpha/r) · A·B per expert, [E, in, out], differentiable."""
        return torch.bmm(self.lora_A, self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"experts={self.lora_A.shape[0]}, rank={self.rank}, alpha={self.alpha:g}"


class LoRAMoEEngine(TRHashMoEEngine):
    """A TRHashMoEEngine whose routed experts run on adapted weights.

    `apply_lora` switches an existing engine to this class in place (no new parameters are
    created for the base weights, names and route buffers stay as they are) and attaches
    `expert_{gate,up,down}_lora` ExpertAdapter children.
    """

    expert_gate_lora: ExpertAdapter
    expert_up_lora: ExpertAdapter
    expert_down_lora: ExpertAdapter

    def effective_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) with W + (alpha/r) · A·B folded in, differentiable w.r.t. A and B."""
        gate, up, down = (getattr(self, name) + getattr(self, name + _EXPERT_ADAPTER_SUFFIX).delta()
                          for name in EXPERT_WEIGHTS)
        return gate, up, down

    def merged_expert_weights(self) -> dict[str, torch.Tensor]:
        """Detached W + delta per stacked weight, summed in fp32, in the weight's dtype."""
        out = {}
        for name in EXPERT_WEIGHTS:
            weight = getattr(self, name).detach()
            delta = getattr(self, name + _EXPERT_ADAPTER_SUFFIX).delta().detach()
            out[name] = (weight.float() + delta.float()).to(weight.dtype)
        return out


# ----------------------------------------------------------------------------- set-up


def _check_hyper(rank: object, alpha: float, dropout: float) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise LoRAError(f"LoRA mode needs a positive rank; pass --lora-rank N or use --full-parameter "
                        f"(got rank {rank!r})")
    if not alpha > 0:
        raise LoRAError(f"LoRA alpha must be > 0, got {alpha!r}")
    if not 0 <= dropout < 1:
        raise LoRAError(f"LoRA dropout must be in [0, 1), got {dropout!r}")


def apply_lora(model: TRHashForCausalLM, lora: LoraSection) -> list[str]:
    """Wrap `lora.targets` in every layer (and the routed experts when `lora.experts`),
    freeze every other parameter, and return the adapted names in model order: linear modules
    (`layers.0.self_attn.q_proj`) and, with experts, stacked weights (`layers.0.mlp.engine.expert_gate`).

    Load the source checkpoint before calling this: the base keys are unchanged afterwards, but a
    strict load then also expects the adapter keys.
    """
    if not lora.enabled:
        raise LoRAError("apply_lora called with lora.enabled false; a full-parameter run has no adapters")
    rank, alpha, dropout = lora.rank, lora.alpha, lora.dropout
    _check_hyper(rank, alpha, dropout)  # a section built in code skips the reader's checks
    targets = tuple(lora.targets)
    experts = bool(lora.experts)
    if not targets and not experts:
        raise LoRAError(f"LoRA needs at least one target; allowed: {', '.join(LINEAR_TARGETS)}")
    unknown = [t for t in targets if t not in LINEAR_TARGETS]
    if unknown:
        raise LoRAError(f"unknown LoRA target(s) {unknown}; allowed: {', '.join(LINEAR_TARGETS)} "
                        f"(routed experts are switched by lora.experts)")
    if len(set(targets)) != len(targets):
        raise LoRAError(f"duplicate LoRA targets in {list(targets)}")
    if any(isinstance(m, (LoRALinear, ExpertAdapter)) for m in model.modules()):
        raise LoRAError("the model already has LoRA adapters; apply_lora must run once")

    for p in model.parameters():
        p.requires_grad_(False)

    wanted = {LINEAR_TARGETS[t] for t in targets}
    adapted = []
    for i, layer in enumerate(model.decoder_layers()):
        for path in LINEAR_TARGETS.values():  # fixed order, whatever the order of `targets`
            if path not in wanted:
                continue
            parent_path, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            base = getattr(parent, leaf)
            if not isinstance(base, nn.Linear):
                raise LoRAError(f"layers.{i}.{path} is a {type(base).__name__}, not nn.Linear")
            setattr(parent, leaf, LoRALinear(base, rank, alpha, dropout))
            adapted.append(f"layers.{i}.{path}")
        if experts:
            engine = layer.mlp.engine
            if type(engine) is not TRHashMoEEngine:
                raise LoRAError(f"layers.{i}.mlp.engine is a {type(engine).__name__}; "
                                "expert adapters need a plain TRHashMoEEngine")
            engine.__class__ = LoRAMoEEngine
            for name in EXPERT_WEIGHTS:
                engine.add_module(name + _EXPERT_ADAPTER_SUFFIX, ExpertAdapter(getattr(engine, name), rank, alpha))
                adapted.append(f"layers.{i}.mlp.engine.{name}")
    return adapted


# ----------------------------------------------------------------------------- state dicts


def is_lora_key(key: str) -> bool:
    """True for adapter tensors (`...lora_A`, `...lora_B`)."""
    return key.endswith(("lora_A", "lora_B"))


def has_lora_state(state_dict: Mapping[str, object]) -> bool:
    """Whether a state dict (or any mapping/iterable of keys) holds LoRA adapter tensors."""
    return any(is_lora_key(k) for k in state_dict)


def check_state_mode(state_dict: Mapping[str, object], lora_enabled: bool, where: str = "checkpoint") -> None:
    """Resume rule (docs/contracts.md §4, §6): a full-parameter run refuses LoRA state, a LoRA run requires it."""
    found = has_lora_state(state_dict)
    if found and not lora_enabled:
        raise LoRAError(f"{where} holds LoRA adapter state but this run is full-parameter; full and "
                        "LoRA runs never resume from each other (merge the adapters with merge_lora "
                        "and start a new stage from the merged weights)")
    if lora_enabled and not found:
        raise LoRAError(f"{where} holds no LoRA adapter state but this run is in LoRA mode; full and "
                        "LoRA runs never resume from each other (use --init-checkpoint to start LoRA "
                        "from these weights)")


def lora_state_dict(model: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """Adapter tensors only, under their full model keys."""
    return OrderedDict((k, v) for k, v in model.state_dict().items() if is_lora_key(k))


def load_lora_state_dict(model: nn.Module, adapter_state: Mapping[str, torch.Tensor]) -> None:
    """Load adapter tensors into a wrapped model; the keys must match its adapters exactly."""
    own = lora_state_dict(model)
    if not own:
        raise LoRAError("the model has no LoRA adapters; call apply_lora first")
    non_adapter = sorted(k for k in adapter_state if not is_lora_key(k))
    missing, unexpected = sorted(set(own) - set(adapter_state)), sorted(set(adapter_state) - set(own))
    if non_adapter or missing or unexpected:
        raise LoRAError(f"adapter state does not match the model: missing {missing[:4]}, "
                        f"unexpected {unexpected[:4]}, non-adapter keys {non_adapter[:4]}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in adapter_state.items():
            if tuple(value.shape) != tuple(params[key].shape):
                raise LoRAError(f"{key}: shape {list(value.shape)} != model's {list(params[key].shape)}")
            params[key].copy_(value)


def merge_lora(model: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """A plain state dict with every adapter folded into its base weight and no adapter keys:
    the keys of an unwrapped TRHashForCausalLM. The model itself is not changed; unmerged
    tensors are the model's own (detached, shared storage), merged ones are new."""
    merged: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, LoRALinear):
            merged[prefix + "weight"] = module.merged_weight()
        elif isinstance(module, LoRAMoEEngine):
            for weight_name, value in module.merged_expert_weights().items():
                merged[prefix + weight_name] = value
    out = OrderedDict()
    for key, value in model.state_dict().items():
        if not is_lora_key(key):
            out[key] = merged.get(key, value)
    return out


def merge_lora_state_dict(state_dict: Mapping[str, torch.Tensor], alpha: float) -> "OrderedDict[str, torch.Tensor]":
    """`merge_lora` on a saved state dict, without building the model: each `P.lora_A`/`P.lora_B`
    pair folds into `P.weight`, each `E.expert_x_lora.lora_A`/`lora_B` into `E.expert_x`;
    r is read from the adapter shapes, alpha must be the run's `lora.alpha`."""
    if not alpha > 0:
        raise LoRAError(f"LoRA alpha must be > 0, got {alpha!r}")
    out = OrderedDict((k, v) for k, v in state_dict.items() if not is_lora_key(k))
    prefixes = sorted({k[: -len(".lora_A")] for k in state_dict if k.endswith(_ADAPTER_SUFFIXES)})
    for prefix in prefixes:
        a, b = state_dict.get(prefix + ".lora_A"), state_dict.get(prefix + ".lora_B")
        if a is None or b is None:
            raise LoRAError(f"{prefix}: adapter has only one of lora_A/lora_B")
        if a.ndim == 2:  # linear: A [r, in], B [out, r]; W [out, in]
            key, rank = prefix + ".weight", a.shape[0]
            delta = b.float() @ a.float()
        elif a.ndim == 3 and prefix.endswith(_EXPERT_ADAPTER_SUFFIX):  # A [E, in, r], B [E, r, out]
            key, rank = prefix[: -len(_EXPERT_ADAPTER_SUFFIX)], a.shape[-1]
            delta = torch.bmm(a.float(), b.float())
        else:
            raise LoRAError(f"{prefix}: unrecognised adapter shape {list(a.shape)}")
        if key not in out:
            raise LoRAError(f"{prefix}: adapter without its base tensor {key}")
        base = out[key]
        if tuple(delta.shape) != tuple(base.shape):
            raise LoRAError(f"{prefix}: adapter product {list(delta.shape)} does not fit {key} {list(base.shape)}")
        out[key] = (base.float() + delta * (alpha / rank)).to(base.dtype)
    return out


def trainable_parameter_count(model: nn.Module) -> int:
    """Number of parameter elements that will be trained (requires_grad)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
