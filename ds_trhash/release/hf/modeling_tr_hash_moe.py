"""transformers implementation of a ds-trhash TR-HASH export (``TRHashForCausalLM``).

Copied verbatim into every export and loaded by ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)``; it imports only torch and transformers. Tensor names are the
trainer's own (no ``model.`` prefix, no ``lm_head``: logits = h @ embed_tokens.weight.T), so
``model.safetensors`` loads without renaming. The arithmetic follows the trainer's PyTorch
reference path: RMSNorm statistics and RoPE in fp32, QK-norm before rotate-half RoPE, grouped
query attention, a shared SwiGLU expert plus two routed SwiGLU experts per token.

Routing is data: ``route_table`` / ``fused_route_codes`` / ``fused_expert_pairs`` come from the
checkpoint and are never rebuilt here; a model whose tables were not loaded refuses to run.
``self_attn.rotary_emb.inv_freq`` is persisted too (fp32), because transformers 5 leaves a
buffer that is absent from the checkpoint uninitialised; it stays fp32 through ``model.to``,
and a copy rounded by a low-precision load is recomputed rather than used.

The KV cache is transformers' ``DynamicCache`` (same ``update``/``get_seq_length`` in 4.5x and
5.x). transformers 5.2x names it ``cache`` where 4.5x says ``past_key_values``: forward accepts
either and returns it under the name the installed ``CausalLMOutputWithPast`` defines. Positions
are derived from ``attention_mask``, so left-padded batches generate correctly.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast
import os
import shutil

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_tr_hash_moe import TRHashConfig

# The output field that carries the cache in the installed transformers release.
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """fp32 [D/2]: the rotary frequencies (the trainer's formula)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


class TRHashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # statistics in fp32; cast back before the scale, like the trainer
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class TRHashRotaryEmbedding(nn.Module):
    def __init__(self, config: TRHashConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", rope_inv_freq(self.head_dim, self.theta), persistent=True)

    inv_freq: torch.Tensor  # a registered buffer

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TRHashRotaryEmbedding:
        """model.to(bfloat16) / .half() move the frequencies but keep them fp32."""
        kept = self.inv_freq
        super()._apply(fn, recurse)
        if kept.dtype == torch.float32 and self.inv_freq.dtype != torch.float32 and not kept.is_meta:
            self.inv_freq = kept.to(self.inv_freq.device)
        return self

    def frequencies(self) -> torch.Tensor:
        """fp32 [D/2]; a copy that a low-precision load rounded is recomputed, not used."""
        if self.inv_freq.dtype == torch.float32:
            return self.inv_freq
        return rope_inv_freq(self.head_dim, self.theta).to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> cos, sin [B, 1, T, D] in fp32."""
        angles = position_ids.to(torch.float32)[..., None] * self.frequencies()
        angles = torch.cat((angles, angles), dim=-1)  # rotate-half pairs i with i + D/2
        return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class TRHashAttention(nn.Module):
    def __init__(self, config: TRHashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_width, kv_width = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        setattr(self.o_proj, "residual_output", True)  # depth-scaled init
        self.q_norm = TRHashRMSNorm(self.head_dim, config.norm_eps)
        self.k_norm = TRHashRMSNorm(self.head_dim, config.norm_eps)
        self.rotary_emb = TRHashRotaryEmbedding(config)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                cache: Cache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(position_ids)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, heads, T, D]
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # [B, kv_heads, past + T, D]
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class TRHashMoEEngine(nn.Module):
    """Shared SwiGLU expert plus the two routed experts each token's id selects."""

    route_table: torch.Tensor  # the registered buffers
    fused_route_codes: torch.Tensor
    fused_expert_pairs: torch.Tensor

    def __init__(self, config: TRHashConfig) -> None:
        super().__init__()
        e, h, w = config.num_experts, config.hidden_size, config.expert_width
        self.vocab_size = config.vocab_size
        self.route_weights = tuple(float(x) for x in config.route_weights)  # Python scalars, not a buffer
        self.shared_scale, self.routed_scale = config.shared_output_scale, config.routed_output_scale
        self.expert_gate = nn.Parameter(torch.empty(e, h, w))
        self.expert_up = nn.Parameter(torch.empty(e, h, w))
        self.expert_down = nn.Parameter(torch.empty(e, w, h))
        self.shared_gate = nn.Linear(h, config.shared_intermediate_size, bias=False)
        self.shared_up = nn.Linear(h, config.shared_intermediate_size, bias=False)
        self.shared_down = nn.Linear(config.shared_intermediate_size, h, bias=False)
        setattr(self.shared_down, "residual_output", True)
        # Zeros until the checkpoint supplies them: routing is never computed here.
        self.register_buffer("route_table", torch.zeros(2, config.vocab_size, dtype=torch.int64))
        self.register_buffer("fused_route_codes", torch.zeros(config.vocab_size, dtype=torch.uint8))
        self.register_buffer("fused_expert_pairs", torch.zeros(e * (e - 1) // 2, 2, dtype=torch.int32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], token_ids [N] -> [N, H]."""
        routes = self.route_table[:, token_ids.clamp(0, self.vocab_size - 1)].t()  # [N, 2]
        shared = self.shared_down(F.silu(self.shared_gate(x)) * self.shared_up(x))
        weights = torch.tensor(self.route_weights, dtype=x.dtype, device=x.device)
        routed = torch.zeros_like(x)
        for e in range(self.expert_gate.shape[0]):
            hit = routes == e  # [N, 2]; a token never meets the same expert twice
            idx = hit.any(dim=1).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            w = (hit[idx].to(x.dtype) * weights).sum(dim=1, keepdim=True)  # [n_e, 1]
            xe = x.index_select(0, idx)
            he = F.silu(xe @ self.expert_gate[e]) * (xe @ self.expert_up[e]) * w
            routed.index_add_(0, idx, (he @ self.expert_down[e]).to(routed.dtype))
        return self.shared_scale * shared + self.routed_scale * routed

    def check_routes(self, layer: int) -> None:
        table = self.route_table
        bad = (table < 0) | (table >= self.expert_gate.shape[0])
        if bool(bad.any()) or bool((table[0] == table[1]).any()):
            raise ValueError(f"layers.{layer}.mlp.engine.route_table is not a valid routing (missing from the "
                             "checkpoint or damaged); TR-HASH routes come only from the saved weights")


class TRHashMLP(nn.Module):
    def __init__(self, config: TRHashConfig) -> None:
        super().__init__()
        self.engine = TRHashMoEEngine(config)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        return self.engine(x.reshape(b * t, h), token_ids.reshape(b * t)).view(b, t, h)


class TRHashDecoderLayer(nn.Module):
    def __init__(self, config: TRHashConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = TRHashRMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = TRHashAttention(config, layer_idx)
        self.post_attention_layernorm = TRHashRMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = TRHashMLP(config)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                cache: Cache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), position_ids, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x), token_ids)


def attention_mask_4d(attention_mask: torch.Tensor | None, batch: int, q_len: int, past: int,
                      device: torch.device) -> torch.Tensor | None:
    """bool [B, 1, q, past + q] (True = may attend), or None when plain causal attention (or
    none, for one new token) is exact. A padding query keeps its own key so no softmax row is empty."""
    k_len = past + q_len
    if attention_mask is not None and attention_mask.shape[-1] != k_len:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions; expected past + new = {k_len}")
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    if not padded and (past == 0 or q_len == 1):
        return None
    q_pos = torch.arange(past, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None, None]  # [1, 1, q, k]
    if attention_mask is not None and padded:
        allowed = (allowed & attention_mask.bool()[:, None, None, :]) | (k_pos == q_pos)
    return allowed.expand(batch, 1, q_len, k_len)


class TRHashPreTrainedModel(PreTrainedModel):
    config_class = TRHashConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["TRHashDecoderLayer"]
    _supports_cache_class = True
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Fresh-model init (the trainer's): normal(0, std), residual outputs depth-scaled.
        Route buffers stay zero: a model without loaded routing refuses to run."""
        std = self.config.initializer_range
        residual_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, residual_std if getattr(module, "residual_output", False) else std)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, TRHashRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, TRHashRotaryEmbedding):
            module.inv_freq.copy_(rope_inv_freq(module.head_dim, module.theta))
        elif isinstance(module, TRHashMoEEngine):
            module.expert_gate.normal_(0.0, std)
            module.expert_up.normal_(0.0, std)
            module.expert_down.normal_(0.0, residual_std)
            for buffer in (module.route_table, module.fused_route_codes, module.fused_expert_pairs):
                buffer.zero_()


class TRHashForCausalLM(TRHashPreTrainedModel, GenerationMixin):
    def __init__(self, config: TRHashConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TRHashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TRHashRMSNorm(config.hidden_size, config.norm_eps)
        self._checked_routes: tuple | None = None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = cast(nn.Embedding, value)

    def get_output_embeddings(self) -> None:
        return None  # the head is embed_tokens itself; there is no separate module to tie

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:  # Any: transformers'
        """transformers' save, plus this model's two code files where a release (4.5x) would not
        copy them, so that the saved directory loads with trust_remote_code like the export."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            here = os.path.dirname(os.path.abspath(__file__))
            for name in ("configuration_tr_hash_moe.py", "modeling_tr_hash_moe.py"):
                if not os.path.exists(os.path.join(save_directory, name)):
                    shutil.copyfile(os.path.join(here, name), os.path.join(save_directory, name))

    def _check_routes(self) -> None:
        """Validate the route tables once per loaded version (not on every decoding step)."""
        engines = [cast(TRHashDecoderLayer, layer).mlp.engine for layer in self.layers]
        key = tuple((e.route_table.data_ptr(), e.route_table._version) for e in engines)
        if key != self._checked_routes:
            for i, engine in enumerate(engines):
                engine.check_routes(i)
            self._checked_routes = key

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      use_cache: bool = True, **kwargs: object) -> dict[str, object]:
        """Feed only the tokens the cache has not seen; positions come from attention_mask."""
        name = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(name)
        seen = cache.get_seq_length() if isinstance(cache, Cache) else 0
        inputs = {"input_ids": input_ids[:, seen:], "attention_mask": attention_mask, name: cache, "use_cache": use_cache}
        if "logits_to_keep" in kwargs:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs: object) -> CausalLMOutputWithPast | tuple:
        if kwargs.get("cache") is not None:
            past_key_values = cast(Cache, kwargs["cache"])
        if kwargs.get("output_attentions"):
            raise ValueError("TR-HASH attention runs through scaled_dot_product_attention; attention weights "
                             "are not returned (output_attentions is not supported)")
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("TR-HASH needs input_ids (routing is by token id); inputs_embeds is not supported")
        if past_key_values is not None and not isinstance(past_key_values, Cache):
            raise ValueError("past_key_values must be a transformers Cache (e.g. DynamicCache), not tuples")
        self._check_routes()
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        output_hidden_states = bool(output_hidden_states if output_hidden_states is not None
                                    else getattr(self.config, "output_hidden_states", False))
        b, q_len = input_ids.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            if attention_mask is not None:  # left padding: each row counts its own real tokens
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = torch.arange(past, past + q_len, device=input_ids.device).expand(b, q_len)
        mask = attention_mask_4d(attention_mask, b, q_len, past, input_ids.device)
        x = self.embed_tokens(input_ids)
        hidden = [x] if output_hidden_states else None
        for layer in self.layers:
            x = layer(x, input_ids, position_ids, mask, past_key_values)
            if hidden is not None:
                hidden.append(x)
        x = self.norm(x)
        if hidden is not None:
            hidden[-1] = x
        if isinstance(logits_to_keep, int):
            kept = x[:, -logits_to_keep:] if logits_to_keep > 0 else x
        else:
            kept = x[:, logits_to_keep]
        logits = F.linear(kept, self.embed_tokens.weight)  # tied head: [B, T, V]
        loss = None
        if labels is not None:  # transformers convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=tuple(hidden) if hidden is not None else None,
                                     **{_CACHE_FIELD: past_key_values if use_cache else None})  # type: ignore[arg-type]  # the cache field's name depends on the transformers version
        if return_dict is False:
            return out.to_tuple()
        return out


__all__ = ["TRHashConfig", "TRHashForCausalLM", "TRHashPreTrainedModel"]
