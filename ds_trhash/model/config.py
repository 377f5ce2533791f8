"""Model hyper-parameters for TR-HASH (docs/contracts.md §1).

The config is frozen so that a model, its route tables and its checkpoint metadata can never
drift apart after construction; derive a new one with `dataclasses.replace` instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ROUTE_METHODS = ("token_id_multi_hash",)


@dataclass(frozen=True)
class TRHashConfig:
    """Every number needed to rebuild a TR-HASH model; defaults are the released 200M model."""

    vocab_size: int = 32000
    hidden_size: int = 896
    num_layers: int = 16
    num_heads: int = 14
    num_kv_heads: int = 2
    head_dim: int = 64
    shared_width: int = 3072
    num_experts: int = 4
    expert_width: int = 64
    top_k: int = 2
    route_weights: tuple[float, float] = (0.5, 0.5)
    shared_scale: float = 1.0
    routed_scale: float = 2.0
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    route_seed: int = 0x71D5A17
    route_method: str = "token_id_multi_hash"
    hash_channels: int = 2
    loss_chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        # JSON/YAML hand us lists; a tuple keeps the frozen config hashable.
        object.__setattr__(self, "route_weights", tuple(float(w) for w in self.route_weights))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "shared_width", "num_experts", "expert_width", "max_seq_len",
                     "hash_channels", "loss_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TRHashConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"TRHashConfig: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2 != 0:
            raise ValueError(f"TRHashConfig.head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.top_k != 2:
            raise ValueError(f"TRHashConfig.top_k must be 2 (routes and pair codes are top-2), got {self.top_k}")
        if not 2 <= self.num_experts <= 8:
            raise ValueError(f"TRHashConfig.num_experts must be in [2, 8], got {self.num_experts}")
        if len(self.route_weights) != self.top_k:
            raise ValueError(
                f"TRHashConfig.route_weights needs {self.top_k} values, got {self.route_weights}")
        if self.route_method not in ROUTE_METHODS:
            raise ValueError(
                f"TRHashConfig.route_method {self.route_method!r} is unknown; allowed: {list(ROUTE_METHODS)}")
        if not 0 <= self.route_seed < 2**32:
            raise ValueError(f"TRHashConfig.route_seed must fit in 32 bits, got {self.route_seed}")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ValueError("TRHashConfig: norm_eps, init_std and rope_theta must be positive")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "TRHashConfig":
        """Named sizes; overrides let tests shrink one field without restating the rest."""
        if name not in PRESETS:
            raise ValueError(f"unknown TR-HASH preset {name!r}; allowed: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (tuples become lists) for checkpoints and run records."""
        out = dataclasses.asdict(self)
        out["route_weights"] = list(self.route_weights)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TRHashConfig":
        """Strict inverse of to_dict: a typo'd key must not silently fall back to a default."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TRHashConfig keys {unknown}; allowed: {sorted(known)}")
        return cls(**data)


PRESETS: dict[str, TRHashConfig] = {
    "200m": TRHashConfig(),
    "tiny": TRHashConfig(
        vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32, shared_width=256, num_experts=4, expert_width=16, max_seq_len=256,
    ),
}
