"""Model hyper-parameters for TR-HASH (docs/contracts.md §1).

The config is frozen so that a model, its route tables and its checkpoint metadata can never
drift apart after construction; derive a new one with `dataclasses.replace` instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ds_trhash.config_fields import non_negative, optional, positive, setting
from ds_trhash.errors import UserError

ROUTE_METHODS = ("token_id_multi_hash",)
HF_MODEL_TYPE = "tr_hash_moe"  # an export's config.json (transformers' model_type)


#: The integer fields of a model's shape (every one a positive integer).
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                   "shared_width", "num_experts", "expert_width", "max_seq_len", "hash_channels",
                   "loss_chunk_tokens")
EXPERT_RANGE = (2, 8)  # routes are top-2 of distinct experts; pair indices fit the released 3-bit code up to 4


def positive_problem(fields: dict[str, Any]) -> tuple[str, str] | None:
    """The first of POSITIVE_FIELDS that is not a positive integer, as (field, problem)."""
    for name in POSITIVE_FIELDS:
        value = fields[name]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return name, f"must be a positive integer, got {value!r}"
    return None


def shape_problem(fields: dict[str, Any]) -> tuple[str, str] | None:
    """The first rule a set of TRHashConfig values breaks, as (field name, problem), else None.

    One place for the model's own rules: the config class raises on them, and the training
    config loader reports them under the YAML key (``model.<field>``) before anything exists.
    """
    problem = positive_problem(fields)
    if problem:
        return problem
    heads, kv = fields["num_heads"], fields["num_kv_heads"]
    if heads % kv != 0:
        return "num_kv_heads", (f"{kv} must divide num_heads {heads}: num_heads must be a multiple of "
                                f"num_kv_heads for grouped-query attention")
    if fields["head_dim"] % 2 != 0:
        return "head_dim", f"must be even for rotate-half RoPE, got {fields['head_dim']}"
    if fields["top_k"] != 2:
        return "top_k", f"must be 2 (routes and pair codes are top-2), got {fields['top_k']}"
    low, high = EXPERT_RANGE
    if not low <= fields["num_experts"] <= high:
        return "num_experts", f"must be in [{low}, {high}], got {fields['num_experts']}"
    if len(fields["route_weights"]) != fields["top_k"]:
        return "route_weights", f"needs {fields['top_k']} values, got {tuple(fields['route_weights'])}"
    if fields["route_method"] not in ROUTE_METHODS:
        return "route_method", f"{fields['route_method']!r} is unknown; allowed: {list(ROUTE_METHODS)}"
    if not isinstance(fields["route_seed"], int) or not 0 <= fields["route_seed"] < 2**32:
        return "route_seed", f"must fit in 32 bits (0 <= route_seed < 2**32), got {fields['route_seed']}"
    for name in ("norm_eps", "init_std", "rope_theta"):
        if not fields[name] > 0:
            return name, f"must be positive, got {fields[name]!r}"
    return None


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
        problem = shape_problem(dataclasses.asdict(self))
        if problem:
            raise ValueError(f"TRHashConfig.{problem[0]} {problem[1]}")

    @classmethod
    def from_preset(cls, name: str, **overrides: int | float | str | tuple[float, float]) -> "TRHashConfig":
        """Named sizes; overrides let tests shrink one field without restating the rest."""
        if name not in PRESETS:
            raise ValueError(f"unknown TR-HASH preset {name!r}; allowed: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)  # type: ignore[arg-type]  # each field checked in __post_init__

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


# ----------------------------------------------------------------------------- any size

#: The architecture fields a training config may set (under these names) instead of, or on top
#: of, a preset.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "shared_width", "num_experts", "expert_width", "max_seq_len", "hash_channels", "route_seed")
#: What a shape without a preset must state; head_dim follows from hidden_size / num_heads, and the
#: hash channels and route seed default to the released ones.
REQUIRED_WITHOUT_PRESET = tuple(f for f in SHAPE_FIELDS if f not in ("head_dim", "hash_channels", "route_seed"))


# ----------------------------------------------------------------------------- the config's model: section

_SHAPE = optional(positive)


@dataclass(frozen=True)
class ModelSection:
    """The config's ``model:`` section (the YAML keys are these field names)."""

    # A named size, or null with the architecture below given field by field; a preset plus some
    # of those fields is the preset with them replaced (ds_trhash.model.config.resolve_shape).
    preset: Literal["200m", "tiny"] | None = None
    # "vision" integrates refinement in its own recipe, so the stage guard lets it go
    # pretraining -> SFT directly.
    family: Literal["language", "vision"] = "language"
    # Recompute decoder layers in backward instead of keeping their activations: none, every
    # layer (full) or every activation_checkpointing_every-th layer (every_n). Same gradients.
    activation_checkpointing: Literal["none", "full", "every_n"] = "none"
    activation_checkpointing_every: int = setting(2, check=positive)
    # The architecture, under the model's own field names (model.config.SHAPE_FIELDS); null: the
    # preset's value. Combinations are checked at load (checks.py).
    vocab_size: int | None = setting(None, check=_SHAPE)
    hidden_size: int | None = setting(None, check=_SHAPE)
    num_layers: int | None = setting(None, check=_SHAPE)
    num_heads: int | None = setting(None, check=_SHAPE)
    num_kv_heads: int | None = setting(None, check=_SHAPE)
    head_dim: int | None = setting(None, check=_SHAPE)
    shared_width: int | None = setting(None, check=_SHAPE)
    num_experts: int | None = setting(None, check=_SHAPE)
    expert_width: int | None = setting(None, check=_SHAPE)
    max_seq_len: int | None = setting(None, check=_SHAPE)
    hash_channels: int | None = setting(None, check=_SHAPE)
    route_seed: int | None = setting(None, check=optional(non_negative))

    def shape_overrides(self) -> dict[str, int]:
        """The architecture fields this section sets (the rest come from the preset)."""
        return {name: getattr(self, name) for name in SHAPE_FIELDS if getattr(self, name) is not None}

    def describe(self) -> str:
        """The model for messages: "preset tiny", "preset tiny with hidden_size=96", or "a custom
        shape (vocab_size=..., ...)"."""
        fields = ", ".join(f"{k}={v}" for k, v in self.shape_overrides().items())
        if self.preset is None:
            return f"a custom shape ({fields})"
        return f"preset {self.preset}" + (f" with {fields}" if fields else "")


class ShapeError(UserError, ValueError):
    """A model shape that cannot be built; ``field`` names the offending field."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


def _head_dim(preset: str | None, given: dict[str, int], base: TRHashConfig) -> int:
    """head_dim as given; else the preset's when the width and heads are the preset's; else
    hidden_size / num_heads (which must divide)."""
    if "head_dim" in given:
        return given["head_dim"]
    hidden, heads = given.get("hidden_size", base.hidden_size), given.get("num_heads", base.num_heads)
    if preset is not None and "hidden_size" not in given and "num_heads" not in given:
        return base.head_dim
    if hidden % heads:
        raise ShapeError("num_heads", f"{heads} heads do not fit hidden_size {hidden}: each head is "
                                      "hidden_size / num_heads wide; choose num_heads dividing hidden_size")
    return hidden // heads


def resolve_shape(preset: str | None, given: dict[str, int]) -> TRHashConfig:
    """The model of a preset with ``given`` fields replaced, or (no preset) of ``given`` alone.

    Raises ShapeError naming the field: a missing one, heads that do not fit the width
    (num_heads · head_dim must equal hidden_size), and every rule of the config itself. Only
    shape arithmetic: nothing is allocated. A preset without overrides is exactly the preset.
    """
    unknown = sorted(set(given) - set(SHAPE_FIELDS))
    if unknown:
        raise ShapeError(unknown[0], f"not a shape field; allowed: {', '.join(SHAPE_FIELDS)}")
    if preset is None:
        if not given:
            raise ShapeError("preset", f"missing; expected {' | '.join(repr(p) for p in sorted(PRESETS))}, "
                                       f"or the architecture under its own field names ({', '.join(SHAPE_FIELDS)})")
        missing = [f for f in REQUIRED_WITHOUT_PRESET if f not in given]
        if missing:
            raise ShapeError(missing[0], f"required when no preset is named (the shape is then given field by field; "
                                         f"missing: {', '.join(missing)}); set it, or name a preset: "
                                         f"{', '.join(sorted(PRESETS))}")
        base = TRHashConfig()
    elif preset not in PRESETS:
        raise ShapeError("preset", f"unknown preset {preset!r}; allowed: {', '.join(sorted(PRESETS))}")
    else:
        base = PRESETS[preset]
    if not given:
        return base
    fields = {**dataclasses.asdict(base), **given}
    problem = positive_problem(fields)  # the arithmetic below needs positive integers
    if problem:
        raise ShapeError(*problem)
    fields["head_dim"] = _head_dim(preset, given, base)
    heads, head_dim, hidden = fields["num_heads"], fields["head_dim"], fields["hidden_size"]
    if heads * head_dim != hidden:
        raise ShapeError("head_dim" if "head_dim" in given else "num_heads",
                         f"num_heads x head_dim = {heads} x {head_dim} = {heads * head_dim} does not fit hidden_size "
                         f"{hidden}: the heads must span the width exactly")
    problem = shape_problem(fields)
    if problem:
        raise ShapeError(*problem)
    return TRHashConfig(**fields)
