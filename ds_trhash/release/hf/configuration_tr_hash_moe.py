"""Hugging Face configuration of a ds-trhash TR-HASH export (``model_type = "tr_hash_moe"``).

Copied verbatim into every export beside ``model.safetensors`` and loaded by
``AutoConfig.from_pretrained(dir, trust_remote_code=True)``, so it imports only transformers.
Field names follow the published TR-HASH Hugging Face config; the extra fields (``head_dim``,
``route_weights``, ``route_seed``, ``loss_chunk_tokens``) let the trainer rebuild its own
config from an export exactly. Written against the transformers 5 and 4.5x APIs alike.
"""
from __future__ import annotations

from typing import Any

try:  # transformers 5 spells it PreTrainedConfig; 4.x only PretrainedConfig
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers import PretrainedConfig as _BaseConfig


class TRHashConfig(_BaseConfig):
    """Decoder-only TR-HASH MoE: GQA attention with QK-norm, a shared SwiGLU expert, and
    top-2 routed SwiGLU experts chosen by a persisted token-id hash table."""

    model_type = "tr_hash_moe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 896,
        num_hidden_layers: int = 16,
        num_attention_heads: int = 14,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        intermediate_size: int = 256,
        shared_intermediate_size: int = 3072,
        num_experts: int = 4,
        num_experts_per_tok: int = 2,
        top_k_primary_weight: float = 0.5,
        route_weights: list[float] | None = None,
        routing_strategy: str = "token_id_multi_hash",
        route_hash_count: int = 2,
        route_seed: int = 0x71D5A17,
        shared_expert: bool = True,
        shared_output_scale: float = 1.0,
        routed_output_scale: float = 2.0,
        use_qk_norm: bool = True,
        norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        loss_chunk_tokens: int = 1024,
        attention_type: str = "gqa",
        mlp_type: str = "tr_hash_engine",
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        bos_token_id: int = 2,
        eos_token_id: int = 0,
        pad_token_id: int = 1,
        **kwargs: Any,  # Any: any PreTrainedConfig keyword, passed on
    ) -> None:
        if attention_type != "gqa":
            raise ValueError(f"tr_hash_moe supports attention_type 'gqa' only, got {attention_type!r}")
        if not shared_expert or not use_qk_norm:
            raise ValueError("tr_hash_moe models always have a shared expert and QK-norm "
                             "(shared_expert and use_qk_norm must be true)")
        if num_attention_heads % num_key_value_heads:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_key_value_heads})")
        if intermediate_size % num_experts:
            raise ValueError(f"intermediate_size ({intermediate_size}) must be num_experts ({num_experts}) "
                             "x the expert width")
        if num_experts_per_tok != 2:
            raise ValueError(f"tr_hash_moe routes every token to 2 experts, got num_experts_per_tok={num_experts_per_tok}")
        if not tie_word_embeddings:
            raise ValueError("tr_hash_moe ties the output head to embed_tokens (tie_word_embeddings must be true)")
        self.vocab_size = int(vocab_size)
        self.hidden_size = int(hidden_size)
        self.num_hidden_layers = int(num_hidden_layers)
        self.num_attention_heads = int(num_attention_heads)
        self.num_key_value_heads = int(num_key_value_heads)
        self.head_dim = int(head_dim) if head_dim is not None else self.hidden_size // self.num_attention_heads
        self.intermediate_size = int(intermediate_size)
        self.shared_intermediate_size = int(shared_intermediate_size)
        self.num_experts = int(num_experts)
        self.num_experts_per_tok = int(num_experts_per_tok)
        self.top_k_primary_weight = float(top_k_primary_weight)
        if route_weights is None:  # the published config states only the primary's weight
            route_weights = [self.top_k_primary_weight, 1.0 - self.top_k_primary_weight]
        self.route_weights = [float(w) for w in route_weights]
        self.routing_strategy = routing_strategy
        self.route_hash_count = int(route_hash_count)
        self.route_seed = int(route_seed)
        self.shared_expert = True
        self.shared_output_scale = float(shared_output_scale)
        self.routed_output_scale = float(routed_output_scale)
        self.use_qk_norm = True
        self.norm_eps = float(norm_eps)
        self.rope_theta = float(rope_theta)
        self.max_position_embeddings = int(max_position_embeddings)
        self.initializer_range = float(initializer_range)
        self.loss_chunk_tokens = int(loss_chunk_tokens)
        self.attention_type = attention_type
        self.mlp_type = mlp_type
        self.expert_width = self.intermediate_size // self.num_experts
        # save_pretrained writes these back; the values are fixed for a decoder-only model.
        kwargs.pop("is_decoder", None)
        kwargs.pop("is_encoder_decoder", None)
        kwargs.setdefault("architectures", ["TRHashForCausalLM"])
        super().__init__(tie_word_embeddings=True, use_cache=use_cache, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, is_decoder=True,
                         is_encoder_decoder=False, **kwargs)  # type: ignore[call-arg]  # keywords of transformers 4.5x; 5.x stores them from **kwargs
        self.use_cache = bool(use_cache)  # transformers 5 no longer stores every keyword itself
        self.tie_word_embeddings = True


__all__ = ["TRHashConfig"]
