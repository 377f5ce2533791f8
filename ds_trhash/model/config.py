"""Model hyper-parameters for TR-HASH (docs/contracts.md §1).

The config is frozen so that a model, its route tables and its checkpoint metadata can never
drift apart after construction; derive a new one with `dataclasses.replace` instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ROUTE_METHODS = ("token_id_multi_hash",)
HF_MODEL_TYPE = "tr_hash_moe"  # an export's config.json (transformers' model_type)


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

    @classmethod
    def from_saved(cls, data: dict[str, Any]) -> "TRHashConfig":
        """A recorded config in either form: to_dict's, or an export's Hugging Face config.json."""
        return cls.from_hf_fields(data) if data.get("model_type") == HF_MODEL_TYPE else cls.from_dict(data)

    # The published Hugging Face field names (an export's config.json, model_type "tr_hash_moe").
    def to_hf_fields(self) -> dict[str, Any]:
        """This config under the released Hugging Face names, plus the fields the release leaves
        implicit (head_dim, route_weights, route_seed, loss_chunk_tokens) so it converts back exactly."""
        return {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.num_experts * self.expert_width,
            "shared_intermediate_size": self.shared_width, "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k, "top_k_primary_weight": self.route_weights[0],
            "route_weights": list(self.route_weights), "routing_strategy": self.route_method,
            "route_hash_count": self.hash_channels, "route_seed": self.route_seed,
            "shared_expert": True, "shared_output_scale": self.shared_scale,
            "routed_output_scale": self.routed_scale, "use_qk_norm": True, "norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_seq_len,
            "initializer_range": self.init_std, "loss_chunk_tokens": self.loss_chunk_tokens,
            "tie_word_embeddings": True,
        }

    @classmethod
    def from_hf_fields(cls, data: dict[str, Any]) -> "TRHashConfig":
        """Inverse of to_hf_fields; other keys of a Hugging Face config.json are ignored."""
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "shared_intermediate_size", "num_experts")
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"Hugging Face config lacks {missing}; it is not a tr_hash_moe config")
        experts = data["num_experts"]
        if data["intermediate_size"] % experts:
            raise ValueError(f"intermediate_size {data['intermediate_size']} is not a multiple of num_experts {experts}")
        primary = float(data.get("top_k_primary_weight", 0.5))
        fields: dict[str, Any] = {
            "vocab_size": data["vocab_size"], "hidden_size": data["hidden_size"],
            "num_layers": data["num_hidden_layers"], "num_heads": data["num_attention_heads"],
            "num_kv_heads": data["num_key_value_heads"],
            "head_dim": data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"],
            "shared_width": data["shared_intermediate_size"], "num_experts": experts,
            "expert_width": data["intermediate_size"] // experts, "top_k": data.get("num_experts_per_tok", 2),
            "route_weights": tuple(data.get("route_weights") or (primary, 1.0 - primary)),
        }
        optional = {"shared_output_scale": "shared_scale", "routed_output_scale": "routed_scale",
                    "max_position_embeddings": "max_seq_len", "rope_theta": "rope_theta", "norm_eps": "norm_eps",
                    "initializer_range": "init_std", "route_seed": "route_seed", "routing_strategy": "route_method",
                    "route_hash_count": "hash_channels", "loss_chunk_tokens": "loss_chunk_tokens"}
        fields.update({ours: data[theirs] for theirs, ours in optional.items() if theirs in data})
        return cls(**fields)


PRESETS: dict[str, TRHashConfig] = {
    "200m": TRHashConfig(),
    "tiny": TRHashConfig(
        vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32, shared_width=256, num_experts=4, expert_width=16, max_seq_len=256,
    ),
}
