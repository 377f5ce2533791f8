"""Grouped-query self-attention with QK-norm and rotate-half RoPE (docs/contracts.md §1).

q, k and v stay separate modules (the checkpoint names them separately and LoRA wraps
q_proj/v_proj as modules); the released fused layout is exposed through fused_qkv_weight.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import TRHashConfig
from .norms import RMSNorm

ROPE_BACKENDS = ("pytorch", "liger")


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, D] built in fp32: bf16 angles at position ~2k lose whole radians."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                              dtype=torch.float32) / head_dim))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # rotate-half pairs i with i + D/2
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [B, heads, T, D]; math in fp32, result in x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, T], True = may attend: causal and same document (packed SFT rows)."""
    t = document_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_doc & causal)[:, None]


class TRHashAttention(nn.Module):
    def __init__(self, config: TRHashConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        hidden, q_width, kv_width = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.rope_backend = "pytorch"
        self.last_rope_backend: str | None = None
        self.init_std = config.init_std
        self.residual_std = config.init_std / math.sqrt(2 * config.num_layers)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The contract init (docs/contracts.md §1); o_proj writes into the residual stream, so it gets the depth-scaled std."""
        with torch.no_grad():
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                proj.weight.normal_(0.0, self.init_std)
            self.o_proj.weight.normal_(0.0, self.residual_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def fused_qkv_weight(self) -> torch.Tensor:
        """[kv + q + kv, H] in the released fused row order K, Q, V (docs/contracts.md §1)."""
        return torch.cat((self.k_proj.weight, self.q_proj.weight, self.v_proj.weight), dim=0)

    def load_fused_qkv_weight(self, fused: torch.Tensor) -> None:
        """Inverse of fused_qkv_weight, for importing released fused checkpoints."""
        kv = self.num_kv_heads * self.head_dim
        k, q, v = fused.split((kv, self.num_heads * self.head_dim, kv), dim=0)
        with torch.no_grad():
            self.k_proj.weight.copy_(k)
            self.q_proj.weight.copy_(q)
            self.v_proj.weight.copy_(v)

    def _rope(self, q, k, cos, sin):
        if self.rope_backend == "liger":
            from liger_kernel.transformers.functional import liger_rope

            # Liger rotates in cos/sin's dtype (fp32 here) and stores in q/k's dtype, like apply_rope.
            q, k = liger_rope(q, k, cos, sin)
        elif self.rope_backend == "pytorch":
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            raise ValueError(f"unknown rope backend {self.rope_backend!r}; allowed: {list(ROPE_BACKENDS)}")
        self.last_rope_backend = self.rope_backend
        return q, k

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta)
        q, k = self._rope(q, k, cos, sin)  # [B, heads, T, D]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
            scale=self.head_dim ** -0.5, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
